//! ListVolumes, ListSnapshots and GetCapacity: over every pool of every cluster the
//! controller can reach (the clusters of its list with its own credentials, and those it has
//! an open connection to), in id order, paged by id.

use std::collections::{BTreeMap, BTreeSet};

use tracing::{debug, warn};

use super::ids::{ClusterRef, Location, SnapshotId, VolumeId, pool_ok};
use super::parameters::location_of;
use super::records::{Registry, SnapshotState, VolumeState};
use super::snapshots::snapshot_of;
use super::volumes::volume_of;
use super::{MAX_SIZE, POLICY, RbdBackend, Session};
use crate::backend::{
    self, Capacity, CapacityQuery, Page, PageRequest, Snapshot, SnapshotFilter, VolumeCondition,
    VolumeStatus,
};
use crate::error::{Error, Result, trunc};

fn bad_token(token: &str) -> Error {
    Error::InvalidToken {
        token: trunc(token).to_string(),
        reason: "not a token this controller hands out".into(),
    }
}

impl RbdBackend {
    /// Clusters to list: those of the list with the controller's own credentials, and those
    /// with an open connection.
    fn reachable(&self) -> Vec<ClusterRef> {
        let mut refs: BTreeSet<ClusterRef> = self
            .clusters()
            .iter()
            .filter(|c| c.credentials.is_some())
            .map(|c| ClusterRef::Id(c.id.clone()))
            .collect();
        refs.extend(self.connections.clusters());
        refs.into_iter().collect()
    }

    /// The RBD pools of a cluster (pools with the `rbd` application).
    pub(super) fn rbd_pools(&self, s: &Session) -> Result<Vec<String>> {
        let out = s
            .cluster()
            .mon_command(&serde_json::json!({"prefix": "osd pool ls", "detail": "detail"}))
            .map_err(|e| self.fail(s, "list pools", e))?;
        let mut pools: Vec<String> = out
            .as_array()
            .into_iter()
            .flatten()
            .filter(|p| {
                p["application_metadata"]
                    .as_object()
                    .is_some_and(|a| a.contains_key("rbd"))
            })
            .filter_map(|p| p["pool_name"].as_str().map(str::to_string))
            .filter(|n| pool_ok(n))
            .collect();
        pools.sort();
        Ok(pools)
    }

    /// Every location to list, with a session on its cluster. A cluster that cannot be
    /// reached is left out (and logged): the others still list.
    fn locations(&self) -> Vec<(Session, Location)> {
        let mut out = Vec::new();
        for cref in self.reachable() {
            let s = match self.session(&cref) {
                Ok(s) => s,
                Err(e) => {
                    debug!(cluster = %cref, error = %e, "not listed: no connection");
                    continue;
                }
            };
            match self.rbd_pools(&s) {
                Ok(pools) => out.extend(pools.into_iter().map(|pool| {
                    (
                        s.clone(),
                        Location {
                            cluster: cref.clone(),
                            pool,
                        },
                    )
                })),
                Err(e) => warn!(cluster = %cref, error = %e, "cannot list its pools"),
            }
        }
        out
    }

    pub(super) fn list_volumes_impl(&self, page: &PageRequest) -> Result<Page<VolumeStatus>> {
        if let Some(t) = &page.starting_token
            && VolumeId::parse(t).is_none()
        {
            return Err(bad_token(t));
        }
        let mut all = BTreeMap::new();
        for (s, loc) in self.locations() {
            let Some(pool) = self.open_pool(&s, &loc.pool)? else {
                continue;
            };
            let records = Registry::new(&pool).volumes()?;
            if records.is_empty() {
                continue;
            }
            let images: BTreeSet<String> = pool
                .images()
                .map_err(|e| self.fail(&s, format!("images of {}", loc.pool), e))?
                .into_iter()
                .map(|i| i.name)
                .collect();
            for (suffix, rec) in records {
                if rec.state != VolumeState::Ready {
                    continue;
                }
                let id = VolumeId {
                    location: loc.clone(),
                    suffix,
                };
                let condition = if images.contains(&id.image()) {
                    VolumeCondition {
                        abnormal: false,
                        message: "volume is healthy".into(),
                    }
                } else {
                    VolumeCondition {
                        abnormal: true,
                        message: format!("image {}/{} is missing", loc.pool, id.image()),
                    }
                };
                let status = VolumeStatus {
                    volume: volume_of(&id, &rec),
                    published_nodes: rec.publications.iter().map(|p| p.node_id.clone()).collect(),
                    condition,
                };
                all.insert(id.to_string(), status);
            }
        }
        Ok(backend::page_after(
            &all,
            page.starting_token.as_deref(),
            page.max_entries,
        ))
    }

    pub(super) fn list_snapshots_impl(
        &self,
        filter: &SnapshotFilter,
        page: &PageRequest,
    ) -> Result<Page<Snapshot>> {
        if let Some(t) = &page.starting_token
            && SnapshotId::parse(t).is_none()
        {
            return Err(bad_token(t));
        }
        let empty = Page {
            entries: Vec::new(),
            next_token: None,
        };
        // A filter narrows the search to one pool.
        let wanted_snapshot = match &filter.snapshot_id {
            Some(raw) => match SnapshotId::parse(raw) {
                Some(sid) => Some(sid),
                None => return Ok(empty),
            },
            None => None,
        };
        let wanted_volume = match &filter.source_volume_id {
            Some(raw) => match VolumeId::parse(raw) {
                Some(vid) => Some(vid),
                None => return Ok(empty),
            },
            None => None,
        };
        let narrowed = wanted_snapshot
            .as_ref()
            .map(|s| s.location.clone())
            .or_else(|| wanted_volume.as_ref().map(|v| v.location.clone()));
        let locations = match narrowed {
            Some(loc) => match self.session(&loc.cluster) {
                Ok(s) => vec![(s, loc)],
                Err(Error::NotReady(_)) => return Ok(empty),
                Err(e) => return Err(e),
            },
            None => self.locations(),
        };
        let mut all = BTreeMap::new();
        for (s, loc) in locations {
            let Some(pool) = self.open_pool(&s, &loc.pool)? else {
                continue;
            };
            let reg = Registry::new(&pool);
            let records = match &wanted_snapshot {
                Some(sid) => reg
                    .snapshot(&sid.suffix)?
                    .map(|r| BTreeMap::from([(sid.suffix.clone(), r)]))
                    .unwrap_or_default(),
                None => reg.snapshots()?,
            };
            for (suffix, rec) in records {
                if rec.state != SnapshotState::Ready {
                    continue;
                }
                if wanted_volume
                    .as_ref()
                    .is_some_and(|v| v.to_string() != rec.source_volume_id)
                {
                    continue;
                }
                let sid = SnapshotId {
                    location: loc.clone(),
                    suffix,
                };
                all.insert(sid.to_string(), snapshot_of(&sid, &rec));
            }
        }
        Ok(backend::page_after(
            &all,
            page.starting_token.as_deref(),
            page.max_entries,
        ))
    }

    pub(super) fn capacity_impl(&self, query: &CapacityQuery) -> Result<Capacity> {
        // RBD volumes have no topology: any segment reaches the cluster.
        // Without a cluster and a pool, no volume can be made: no capacity.
        let Some(loc) = location_of(&query.parameters) else {
            return Ok(Capacity::default());
        };
        let s = self.session(&loc.cluster)?;
        let pool = self.open_pool(&s, &loc.pool)?.ok_or_else(|| {
            Error::invalid(
                "parameters",
                format!("pool {:?} does not exist in {}", loc.pool, loc.cluster),
            )
        })?;
        let c = pool
            .capacity()
            .map_err(|e| self.fail(&s, format!("capacity of {}", loc.pool), e))?;
        Ok(Capacity {
            available: c.available_bytes,
            maximum_volume_size: Some(MAX_SIZE),
            minimum_volume_size: Some(POLICY.granularity),
        })
    }
}
