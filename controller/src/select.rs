//! The backend of each request: the controller serves the embedded backend and the RBD
//! backend side by side, chosen per StorageClass by the `backend` parameter (`embedded`, the
//! default, or `rbd`), and per request by the form of the id it names (RBD ids begin with
//! `rbd/`). Listings page through one backend and then the other.

use std::fmt;

use crate::backend::{
    Backend, Capability, Capacity, CapacityQuery, ExpandRequest, GroupSnapshot, GroupSnapshotRef,
    MetadataSink, NewGroupSnapshot, NewSnapshot, NewVolume, Page, PageRequest, Parameters,
    PublishContext, PublishRequest, Qos, Snapshot, SnapshotFilter, Volume, VolumeStatus,
};
use crate::encryption::rotation::RecordKeys;
use crate::error::{Error, Result, trunc};
use crate::rbd::ids::is_rbd_id;
use crate::rbd::parameters::{BACKEND_KEY, BACKEND_NAME, is_rbd};

/// The value of `backend` that chooses the embedded backend.
pub const EMBEDDED_NAME: &str = "embedded";

/// The backends a controller serves.
pub struct Backends {
    embedded: Option<Box<dyn Backend>>,
    rbd: Option<Box<dyn Backend>>,
}

impl fmt::Debug for Backends {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Backends")
            .field("embedded", &self.embedded.is_some())
            .field("rbd", &self.rbd.is_some())
            .finish()
    }
}

/// Which backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Which {
    Embedded,
    Rbd,
}

impl Backends {
    /// Serves these backends (at least one).
    pub fn new(embedded: Option<Box<dyn Backend>>, rbd: Option<Box<dyn Backend>>) -> Self {
        Self { embedded, rbd }
    }

    fn get(&self, which: Which) -> Option<&dyn Backend> {
        match which {
            Which::Embedded => self.embedded.as_deref(),
            Which::Rbd => self.rbd.as_deref(),
        }
    }

    /// The backend a StorageClass's raw parameters choose; INVALID_ARGUMENT for one this
    /// controller does not serve.
    fn by_raw_parameters(&self, raw: &Parameters) -> Result<(Which, &dyn Backend)> {
        let which = match raw.get(BACKEND_KEY).map(String::as_str) {
            Some(BACKEND_NAME) => Which::Rbd,
            Some(EMBEDDED_NAME) => Which::Embedded,
            None if self.embedded.is_some() => Which::Embedded,
            None => Which::Rbd,
            Some(other) => {
                return Err(Error::invalid(
                    "parameters",
                    format!(
                        "{BACKEND_KEY}={:?}: moor's backends are {EMBEDDED_NAME} and {BACKEND_NAME}",
                        trunc(other)
                    ),
                ));
            }
        };
        let b = self.get(which).ok_or_else(|| {
            Error::invalid(
                "parameters",
                match which {
                    Which::Rbd => "the rbd backend is not enabled on this controller \
                                   (moor-controller --rbd or --rbd-clusters)"
                        .to_string(),
                    Which::Embedded => "the embedded backend is disabled on this controller \
                                        (--no-embedded)"
                        .to_string(),
                },
            )
        })?;
        Ok((which, b))
    }

    /// The backend of normalized parameters.
    fn by_parameters(&self, params: &Parameters) -> Option<&dyn Backend> {
        self.get(if is_rbd(params) {
            Which::Rbd
        } else {
            Which::Embedded
        })
    }

    /// The backend an id belongs to, if it is served.
    fn by_id(&self, id: &str) -> Option<&dyn Backend> {
        self.get(if is_rbd_id(id) {
            Which::Rbd
        } else {
            Which::Embedded
        })
    }

    /// Pages through the embedded backend's entries, then the RBD backend's: a token of the
    /// RBD form starts in the RBD backend.
    fn list_both<T>(
        &self,
        page: &PageRequest,
        list: impl Fn(&dyn Backend, &PageRequest) -> Result<Page<T>>,
        token_of: impl Fn(&T) -> String,
    ) -> Result<Page<T>> {
        let in_rbd = page.starting_token.as_deref().is_some_and(is_rbd_id);
        if let Some(t) = &page.starting_token
            && (if in_rbd {
                self.rbd.is_none()
            } else {
                self.embedded.is_none()
            })
        {
            return Err(Error::InvalidToken {
                token: trunc(t).to_string(),
                reason: "it names a backend this controller does not serve".into(),
            });
        }
        let mut entries = Vec::new();
        if !in_rbd && let Some(e) = self.embedded.as_deref() {
            let p = list(e, page)?;
            if p.next_token.is_some() {
                return Ok(p);
            }
            entries = p.entries;
        }
        let Some(r) = self.rbd.as_deref() else {
            return Ok(Page {
                entries,
                next_token: None,
            });
        };
        let room = if page.max_entries == 0 {
            0
        } else {
            page.max_entries - entries.len().min(page.max_entries)
        };
        if page.max_entries > 0 && room == 0 {
            // The page is full: the next starts at the first RBD entry, if there is one.
            let first = list(
                r,
                &PageRequest {
                    max_entries: 1,
                    starting_token: None,
                },
            )?;
            return Ok(Page {
                next_token: first.entries.first().map(&token_of),
                entries,
            });
        }
        let p = list(
            r,
            &PageRequest {
                max_entries: room,
                starting_token: if in_rbd {
                    page.starting_token.clone()
                } else {
                    None
                },
            },
        )?;
        entries.extend(p.entries);
        Ok(Page {
            entries,
            next_token: p.next_token,
        })
    }
}

fn volume_not_found(id: &str) -> Error {
    Error::VolumeNotFound(trunc(id).to_string())
}

impl Backend for Backends {
    fn parse_parameters(&self, raw: &Parameters) -> Result<Parameters> {
        let (which, b) = self.by_raw_parameters(raw)?;
        match which {
            // The embedded backend does not know the key that chose it.
            Which::Embedded => {
                let mut rest = raw.clone();
                rest.remove(BACKEND_KEY);
                b.parse_parameters(&rest)
            }
            Which::Rbd => b.parse_parameters(raw),
        }
    }

    fn check_capability(&self, cap: &Capability, parameters: &Parameters) -> Result<(), String> {
        match self.by_parameters(parameters) {
            Some(b) => b.check_capability(cap, parameters),
            None => Err("the volume's backend is not enabled on this controller".into()),
        }
    }

    fn probe(&self) -> Result<()> {
        for b in [self.embedded.as_deref(), self.rbd.as_deref()]
            .into_iter()
            .flatten()
        {
            b.probe()?;
        }
        Ok(())
    }

    fn metrics(&self) -> String {
        [self.embedded.as_deref(), self.rbd.as_deref()]
            .into_iter()
            .flatten()
            .map(|b| b.metrics())
            .collect()
    }

    fn create_volume(&self, req: &NewVolume) -> Result<Volume> {
        let b = self
            .by_parameters(&req.parameters)
            .ok_or_else(|| Error::invalid("parameters", "the backend is not enabled"))?;
        if crate::encryption::is_encrypted(&req.parameters) && !b.serves_encryption() {
            return Err(crate::encryption::refuse_backend());
        }
        b.create_volume(req)
    }

    fn serves_encryption(&self) -> bool {
        // Only where the volume goes is known: `create_volume` of a backend that does not
        // serve it refuses, and `record_wrapped_dek` goes to the volume's.
        true
    }

    fn record_wrapped_dek(&self, volume_id: &str, wrapped: &str) -> Result<Volume> {
        self.by_id(volume_id)
            .ok_or_else(|| volume_not_found(volume_id))?
            .record_wrapped_dek(volume_id, wrapped)
    }

    fn volume_keys(&self, volume_id: &str) -> Result<RecordKeys> {
        self.by_id(volume_id)
            .ok_or_else(|| volume_not_found(volume_id))?
            .volume_keys(volume_id)
    }

    fn write_volume_keys(
        &self,
        volume_id: &str,
        before: &RecordKeys,
        after: &RecordKeys,
    ) -> Result<()> {
        self.by_id(volume_id)
            .ok_or_else(|| volume_not_found(volume_id))?
            .write_volume_keys(volume_id, before, after)
    }

    fn write_snapshot_key(&self, snapshot_id: &str, before: &str, after: &str) -> Result<()> {
        self.by_id(snapshot_id)
            .ok_or_else(|| Error::SnapshotNotFound(trunc(snapshot_id).to_string()))?
            .write_snapshot_key(snapshot_id, before, after)
    }

    fn encrypted_volume_ids(&self) -> Result<Vec<String>> {
        let mut ids = Vec::new();
        for b in [self.embedded.as_deref(), self.rbd.as_deref()]
            .into_iter()
            .flatten()
        {
            ids.extend(b.encrypted_volume_ids()?);
        }
        Ok(ids)
    }

    fn delete_volume(&self, volume_id: &str) -> Result<()> {
        match self.by_id(volume_id) {
            Some(b) => b.delete_volume(volume_id),
            None => Ok(()),
        }
    }

    fn publish_volume(&self, req: &PublishRequest) -> Result<PublishContext> {
        self.by_id(&req.volume_id)
            .ok_or_else(|| volume_not_found(&req.volume_id))?
            .publish_volume(req)
    }

    fn unpublish_volume(&self, volume_id: &str, node_id: Option<&str>) -> Result<()> {
        match self.by_id(volume_id) {
            Some(b) => b.unpublish_volume(volume_id, node_id),
            None => Ok(()),
        }
    }

    fn get_volume(&self, volume_id: &str) -> Result<VolumeStatus> {
        self.by_id(volume_id)
            .ok_or_else(|| volume_not_found(volume_id))?
            .get_volume(volume_id)
    }

    fn list_volumes(&self, page: &PageRequest) -> Result<Page<VolumeStatus>> {
        self.list_both(page, |b, p| b.list_volumes(p), |v| v.volume.id.clone())
    }

    fn capacity(&self, query: &CapacityQuery) -> Result<Capacity> {
        match self.by_parameters(&query.parameters) {
            Some(b) => b.capacity(query),
            None => Ok(Capacity::default()),
        }
    }

    fn expand_volume(&self, req: &ExpandRequest) -> Result<u64> {
        self.by_id(&req.volume_id)
            .ok_or_else(|| volume_not_found(&req.volume_id))?
            .expand_volume(req)
    }

    fn modify_volume(&self, volume_id: &str, qos: &Qos) -> Result<()> {
        self.by_id(volume_id)
            .ok_or_else(|| volume_not_found(volume_id))?
            .modify_volume(volume_id, qos)
    }

    fn create_snapshot(&self, req: &NewSnapshot) -> Result<Snapshot> {
        self.by_id(&req.source_volume_id)
            .ok_or_else(|| volume_not_found(&req.source_volume_id))?
            .create_snapshot(req)
    }

    fn delete_snapshot(&self, snapshot_id: &str) -> Result<()> {
        match self.by_id(snapshot_id) {
            Some(b) => b.delete_snapshot(snapshot_id),
            None => Ok(()),
        }
    }

    fn get_snapshot(&self, snapshot_id: &str) -> Result<Snapshot> {
        self.by_id(snapshot_id)
            .ok_or_else(|| Error::SnapshotNotFound(trunc(snapshot_id).to_string()))?
            .get_snapshot(snapshot_id)
    }

    fn list_snapshots(
        &self,
        filter: &SnapshotFilter,
        page: &PageRequest,
    ) -> Result<Page<Snapshot>> {
        // A filter names an object of one backend.
        let named = filter
            .snapshot_id
            .as_deref()
            .or(filter.source_volume_id.as_deref());
        if let Some(id) = named {
            return match self.by_id(id) {
                Some(b) => b.list_snapshots(filter, page),
                None => Ok(Page {
                    entries: Vec::new(),
                    next_token: None,
                }),
            };
        }
        self.list_both(page, |b, p| b.list_snapshots(filter, p), |s| s.id.clone())
    }

    fn create_group_snapshot(&self, req: &NewGroupSnapshot) -> Result<GroupSnapshot> {
        // Every member must live in one backend: a group is cut by one storage system.
        let first = req
            .source_volume_ids
            .first()
            .ok_or_else(|| Error::invalid("source_volume_ids", "must name at least one volume"))?;
        if req
            .source_volume_ids
            .iter()
            .any(|v| is_rbd_id(v) != is_rbd_id(first))
        {
            return Err(Error::GroupRefused(
                "the volumes live in different backends (embedded and rbd)".into(),
            ));
        }
        self.by_id(first)
            .ok_or_else(|| volume_not_found(first))?
            .create_group_snapshot(req)
    }

    fn delete_group_snapshot(&self, req: &GroupSnapshotRef) -> Result<()> {
        match self.by_id(&req.id) {
            Some(b) => b.delete_group_snapshot(req),
            None => Ok(()),
        }
    }

    fn get_group_snapshot(&self, req: &GroupSnapshotRef) -> Result<GroupSnapshot> {
        self.by_id(&req.id)
            .ok_or_else(|| Error::GroupSnapshotNotFound(trunc(&req.id).to_string()))?
            .get_group_snapshot(req)
    }

    fn snapshot_allocated(
        &self,
        snapshot_id: &str,
        start: u64,
        sink: &mut dyn MetadataSink,
    ) -> Result<()> {
        self.by_id(snapshot_id)
            .ok_or_else(|| Error::SnapshotNotFound(trunc(snapshot_id).to_string()))?
            .snapshot_allocated(snapshot_id, start, sink)
    }

    fn snapshot_delta(
        &self,
        base_snapshot_id: &str,
        target_snapshot_id: &str,
        start: u64,
        sink: &mut dyn MetadataSink,
    ) -> Result<()> {
        if is_rbd_id(base_snapshot_id) != is_rbd_id(target_snapshot_id) {
            return Err(Error::invalid(
                "target_snapshot_id",
                "the two snapshots live in different backends: not snapshots of one volume",
            ));
        }
        self.by_id(target_snapshot_id)
            .ok_or_else(|| Error::SnapshotNotFound(trunc(target_snapshot_id).to_string()))?
            .snapshot_delta(base_snapshot_id, target_snapshot_id, start, sink)
    }
}
