//! Thick and thin volumes, and what GetCapacity says of each: a thick volume holds all of its
//! space from the start, thin volumes are held to the overcommit ratio, what GetCapacity
//! offers is what CreateVolume admits, and a volume that does not fit is refused with
//! RESOURCE_EXHAUSTED and leaves nothing behind. (The data dir here is the test machine's
//! temp dir, whose free space moves with everything else the machine does: these tests only
//! compare against it with wide margins. `privileged/tests/controller/local.rs` fills a
//! filesystem of its own.)

use std::os::unix::fs::MetadataExt as _;

use super::*;
use crate::embedded::{Overcommit, PROVISIONING_KEY, space};

fn with_params(name: &str, bytes: i64, params: &[(&str, &str)]) -> csi::CreateVolumeRequest {
    let mut r = create_req(name, bytes);
    for (k, v) in params {
        r.parameters.insert((*k).into(), (*v).into());
    }
    r
}

fn thick_req(name: &str, bytes: i64) -> csi::CreateVolumeRequest {
    with_params(name, bytes, &[(PROVISIONING_KEY, "thick")])
}

impl Fx {
    async fn capacity(&self, params: &[(&str, &str)]) -> csi::GetCapacityResponse {
        self.svc
            .get_capacity(Request::new(csi::GetCapacityRequest {
                parameters: params
                    .iter()
                    .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
                    .collect(),
                ..Default::default()
            }))
            .await
            .unwrap()
            .into_inner()
    }

    /// Nothing of a refused volume is left: no record, no data, no copy in progress.
    fn holds_only(&self, ids: &[&str]) {
        let names = |dir: &Path| -> Vec<String> {
            let mut v: Vec<String> = std::fs::read_dir(dir)
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            v.sort();
            v
        };
        let mut want: Vec<String> = ids.iter().map(|i| format!("{i}.img")).collect();
        want.sort();
        assert_eq!(names(&self.backend.layout().volumes), want);
        assert!(names(&self.backend.layout().tmp).is_empty());
        assert_eq!(
            self.backend
                .list_volumes(&Default::default())
                .unwrap()
                .entries
                .len(),
            ids.len()
        );
    }
}

use crate::backend::Backend as _;

#[tokio::test]
async fn provisioning_is_a_parameter_thin_by_default() {
    let fx = Fx::new("svc-prov-param");
    let thin = fx.create("pvc-thin", 64 * MIB).await;
    let named_thin = fx
        .created(with_params(
            "pvc-thin-named",
            64 * MIB,
            &[(PROVISIONING_KEY, "thin")],
        ))
        .await;
    let thick = fx.created(thick_req("pvc-thick", 16 * MIB)).await;
    // Thin is the default: saying it changes nothing, and is not kept.
    assert!(!thin.volume_context.contains_key(PROVISIONING_KEY));
    assert!(!named_thin.volume_context.contains_key(PROVISIONING_KEY));
    assert_eq!(thick.volume_context[PROVISIONING_KEY], "thick");
    // A thin file holds nothing yet; a thick one all of its size.
    let held = |id: &str| std::fs::metadata(fx.volume_path(id)).unwrap().blocks() * 512;
    assert!(
        held(&thin.volume_id) < (MIB as u64),
        "{}",
        held(&thin.volume_id)
    );
    assert!(
        held(&thick.volume_id) >= 16 * MIB as u64,
        "{}",
        held(&thick.volume_id)
    );
    // Idempotent by its normalised parameters.
    let again = fx
        .created(with_params(
            "pvc-thin",
            64 * MIB,
            &[(PROVISIONING_KEY, "thin")],
        ))
        .await;
    assert_eq!(again.volume_id, thin.volume_id);
    assert_code(
        fx.svc
            .create_volume(Request::new(thick_req("pvc-thin", 64 * MIB)))
            .await,
        Code::AlreadyExists,
    );
    assert_invalid(
        fx.svc
            .create_volume(Request::new(with_params(
                "pvc-x",
                MIB,
                &[(PROVISIONING_KEY, "thinnish")],
            )))
            .await,
        "provisioning",
    );
    // A thick volume grows thick.
    fx.svc
        .controller_expand_volume(Request::new(expand_req(&thick.volume_id, 32 * MIB)))
        .await
        .unwrap();
    assert!(held(&thick.volume_id) >= 32 * MIB as u64);
    // Its snapshot and its clone share no extent with it (on a filesystem that could), and
    // the clone of a thick volume asked thick is thick.
    let snap = fx.snapshot("snap-thick", &thick.volume_id).await.unwrap();
    let mut clone = thick_req("pvc-thick-clone", 32 * MIB);
    clone.volume_content_source = Some(csi::VolumeContentSource {
        r#type: Some(csi::volume_content_source::Type::Snapshot(
            csi::volume_content_source::SnapshotSource {
                snapshot_id: snap.snapshot_id.clone(),
            },
        )),
    });
    let clone = fx.created(clone).await;
    assert!(held(&clone.volume_id) >= 32 * MIB as u64);
}

#[tokio::test]
async fn without_a_ratio_thin_volumes_are_not_limited() {
    let fx = Fx::new("svc-prov-unlimited");
    let c = fx.capacity(&[]).await;
    assert_eq!(c.maximum_volume_size, Some(1 << 60), "any size is made");
    // Far more than the machine has: a sparse file.
    let big = fx.create("pvc-huge", 8 << 40).await;
    assert_eq!(big.capacity_bytes, 8 << 40);
    // A thick one must hold its space: what the filesystem has free, and not a byte more.
    let t = fx.capacity(&[(PROVISIONING_KEY, "thick")]).await;
    assert!(t.available_capacity > 0);
    let too_big = t.available_capacity + 1024 * GIB;
    let e = assert_code(
        fx.svc
            .create_volume(Request::new(thick_req("pvc-thick-huge", too_big)))
            .await,
        Code::ResourceExhausted,
    );
    assert!(e.message().contains("free"), "{}", e.message());
    fx.holds_only(&[&big.volume_id]);
    // Nothing could back all of it: its condition says so before a write fails.
    let condition = |id: String| async {
        fx.svc
            .controller_get_volume(Request::new(csi::ControllerGetVolumeRequest {
                volume_id: id,
            }))
            .await
            .unwrap()
            .into_inner()
            .status
            .unwrap()
            .volume_condition
            .unwrap()
    };
    let c = condition(big.volume_id.clone()).await;
    assert!(
        c.abnormal && c.message.contains("run out of space"),
        "{c:?}"
    );
    let small = fx.created(thick_req("pvc-thick-small", 4 * MIB)).await;
    assert!(!condition(small.volume_id).await.abnormal);
    // And the metrics show the filling.
    let m = fx.backend.metrics();
    for name in [
        "moor_data_dir_free_bytes",
        "moor_thin_unbacked_bytes",
        "moor_thick_available_bytes",
        "moor_thin_available_bytes",
    ] {
        assert!(m.contains(&format!("\n{name} ")), "{name} in {m}");
    }
    assert!(m.contains("\nmoor_thick_volume_bytes 4194304\n"), "{m}");
    assert!(m.contains("\nmoor_volumes 2\n"), "{m}");
    assert!(m.contains("\nmoor_thin_overcommit_milli 0\n"), "{m}");
}

#[tokio::test]
async fn at_a_ratio_thin_volumes_are_admitted_as_capacity_says() {
    let fx = Fx::with_policy(
        "svc-prov-ratio",
        Policy {
            overcommit: Overcommit::ratio(2.0).unwrap(),
            ..Policy::default()
        },
    );
    let s = fx.backend.space().unwrap();
    let thin = fx.capacity(&[]).await;
    let thick_cap = fx.capacity(&[(PROVISIONING_KEY, "thick")]).await;
    // Twice the free space for thin volumes, all of it for thick ones, nothing claimed yet.
    // (Within a tenth: the machine writes meanwhile.)
    let near = |a: i64, b: u64| (a as u64).abs_diff(b) <= (b / 10).max(64 << 20);
    assert!(near(thin.available_capacity, 2 * s.free), "{thin:?} {s:?}");
    assert!(
        near(thick_cap.available_capacity, s.free),
        "{thick_cap:?} {s:?}"
    );
    assert_eq!(
        thin.maximum_volume_size.unwrap() % MIB,
        0,
        "a whole number of allocation units"
    );
    // A thin volume of a quarter of what is offered: the offer shrinks by it, and a thick
    // volume must now leave half of its claim free.
    let quarter = (thin.available_capacity / 4) / MIB * MIB;
    let v = fx.create("pvc-quarter", quarter).await;
    let thin2 = fx.capacity(&[]).await;
    let thick2 = fx.capacity(&[(PROVISIONING_KEY, "thick")]).await;
    assert!(
        near(
            thin2.available_capacity,
            (thin.available_capacity - quarter) as u64
        ),
        "{thin2:?}"
    );
    assert!(
        near(
            thick2.available_capacity,
            (thick_cap.available_capacity - quarter / 2) as u64
        ),
        "{thick2:?}"
    );
    // More than the offer, by far: refused, and nothing is left of it.
    let over = thin2.maximum_volume_size.unwrap() + 512 * GIB;
    let e = assert_code(
        fx.svc
            .create_volume(Request::new(create_req("pvc-over", over)))
            .await,
        Code::ResourceExhausted,
    );
    assert!(
        e.message().contains("overcommit ratio 2"),
        "{}",
        e.message()
    );
    // Growing a thin volume claims too.
    let e = assert_code(
        fx.svc
            .controller_expand_volume(Request::new(expand_req(&v.volume_id, quarter + over)))
            .await,
        Code::ResourceExhausted,
    );
    assert!(e.message().contains("growing"), "{}", e.message());
    assert_eq!(
        std::fs::metadata(fx.volume_path(&v.volume_id))
            .unwrap()
            .len(),
        quarter as u64,
        "not grown"
    );
    fx.holds_only(&[&v.volume_id]);
    // The bounds GetCapacity gives are the model's.
    let s = fx.backend.space().unwrap();
    let oc = fx.backend.policy().overcommit;
    assert!(space::thin_available(&s, oc).is_some());
}

/// What kubelet and csi-resizer take as infeasible.
fn infeasible(code: Code) -> bool {
    moor_runtime::contract::INFEASIBLE_EXPANSION.contains(&code)
}

#[tokio::test]
async fn an_expansion_that_cannot_be_made_leaves_a_working_volume_for_a_smaller_ask() {
    let fx = Fx::new("svc-prov-expand-back");
    let v = fx.created(thick_req("pvc-thick-grow", 4 * MIB)).await;
    let expand = |required_bytes: i64| {
        fx.svc
            .controller_expand_volume(Request::new(csi::ControllerExpandVolumeRequest {
                volume_id: v.volume_id.clone(),
                capacity_range: Some(csi::CapacityRange {
                    required_bytes,
                    limit_bytes: 0,
                }),
                ..Default::default()
            }))
    };
    let size = || {
        std::fs::metadata(fx.volume_path(&v.volume_id))
            .unwrap()
            .len()
    };
    // More than the data dir has free: worth a retry (space may be freed), not infeasible.
    let t = fx.capacity(&[(PROVISIONING_KEY, "thick")]).await;
    let s = assert_code(
        expand(t.available_capacity + 1024 * GIB).await,
        Code::ResourceExhausted,
    );
    assert!(!infeasible(s.code()));
    // Larger than any volume: infeasible.
    let s = assert_code(expand(1 << 61).await, Code::OutOfRange);
    assert!(infeasible(s.code()));
    assert_eq!(size(), 4 * MIB as u64, "nothing grew");
    // The user asks for less: it grows, holds its space, and attaches.
    let r = expand(8 * MIB).await.unwrap().into_inner();
    assert_eq!(r.capacity_bytes, 8 * MIB);
    assert_eq!(size(), 8 * MIB as u64);
    assert!(
        std::fs::metadata(fx.volume_path(&v.volume_id))
            .unwrap()
            .blocks()
            * 512
            >= 8 * MIB as u64,
        "a thick volume holds its new space"
    );
    fx.publish(&v.volume_id).await.expect("publish");
}
