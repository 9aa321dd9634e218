//! The CSI SnapshotMetadata service: which blocks of a snapshot hold data, and which differ
//! between two snapshots of one volume, streamed.
//!
//! The backend runs on the blocking pool and hands its ranges to a [`StreamSink`], which cuts
//! them into fixed-length tuples (the backend's block size), drops those that end at or before
//! the request's `starting_offset`, and sends messages of at most `max_results` tuples through a
//! bounded channel (a slow client slows the backend down; a client that goes away stops it).
//! The handler answers only once the backend has found its snapshots and the offset is within
//! the volume, so NOT_FOUND, INVALID_ARGUMENT and OUT_OF_RANGE are the call's status (and what
//! the metrics count), not an error in the middle of a stream.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use moor_proto::csi::v1 as csi;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::Stream;
use tonic::{Request, Response, Status};
use tracing::{info, warn};

use super::ControllerService;
use crate::backend::{Backend, MetadataSink};
use crate::error::{Error, Result, trunc};
use crate::secrets::{self, Secrets};
use crate::validate::{self, MetadataRequest};

/// Tuples per message when the request leaves it to the plugin.
pub const DEFAULT_MAX_RESULTS: usize = 1024;
/// Most tuples per message, whatever the request asks.
pub const MAX_RESULTS_CAP: usize = 16384;
/// Messages the channel holds before the backend waits for the client.
const CHANNEL_DEPTH: usize = 4;

/// One response message of either RPC.
pub trait MetadataMessage: Send + 'static {
    /// A message of the stream.
    fn message(capacity_bytes: u64, tuples: Vec<csi::BlockMetadata>) -> Self;
}

fn i64_of(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

impl MetadataMessage for csi::GetMetadataAllocatedResponse {
    fn message(capacity_bytes: u64, tuples: Vec<csi::BlockMetadata>) -> Self {
        Self {
            block_metadata_type: csi::BlockMetadataType::FixedLength as i32,
            volume_capacity_bytes: i64_of(capacity_bytes),
            block_metadata: tuples,
        }
    }
}

impl MetadataMessage for csi::GetMetadataDeltaResponse {
    fn message(capacity_bytes: u64, tuples: Vec<csi::BlockMetadata>) -> Self {
        Self {
            block_metadata_type: csi::BlockMetadataType::FixedLength as i32,
            volume_capacity_bytes: i64_of(capacity_bytes),
            block_metadata: tuples,
        }
    }
}

/// The stream a handler answers with.
pub type MetadataStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// Turns a backend's ranges into the messages of a stream (see the module doc).
pub struct StreamSink<T> {
    tx: mpsc::Sender<Result<T, Status>>,
    started: Option<oneshot::Sender<()>>,
    starting_offset: u64,
    max_results: usize,
    capacity: u64,
    block_size: u64,
    /// The end of the last tuple queued: ranges must come in order, without overlap.
    end: u64,
    buf: Vec<csi::BlockMetadata>,
    sent: usize,
}

impl<T> std::fmt::Debug for StreamSink<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamSink")
            .field("starting_offset", &self.starting_offset)
            .field("max_results", &self.max_results)
            .field("capacity", &self.capacity)
            .field("block_size", &self.block_size)
            .field("queued", &self.buf.len())
            .field("sent", &self.sent)
            .finish()
    }
}

impl<T: MetadataMessage> StreamSink<T> {
    fn new(
        tx: mpsc::Sender<Result<T, Status>>,
        started: oneshot::Sender<()>,
        req: &MetadataRequest,
    ) -> Self {
        let max_results = match req.max_results {
            0 => DEFAULT_MAX_RESULTS,
            n => n.min(MAX_RESULTS_CAP),
        };
        Self {
            tx,
            started: Some(started),
            starting_offset: req.starting_offset,
            max_results,
            capacity: 0,
            block_size: 0,
            end: 0,
            buf: Vec::new(),
            sent: 0,
        }
    }

    fn send(&mut self) -> Result<()> {
        let tuples = std::mem::take(&mut self.buf);
        self.tx
            .blocking_send(Ok(T::message(self.capacity, tuples)))
            .map_err(|_| Error::Unavailable("the client went away".into()))?;
        self.sent += 1;
        Ok(())
    }

    /// Sends what is queued; a stream that found nothing still says the volume's size.
    fn finish(&mut self) -> Result<()> {
        if !self.buf.is_empty() || self.sent == 0 {
            self.send()?;
        }
        Ok(())
    }
}

impl<T: MetadataMessage> MetadataSink for StreamSink<T> {
    fn begin(&mut self, capacity_bytes: u64, block_size: u64) -> Result<()> {
        if self.starting_offset > capacity_bytes {
            return Err(Error::OffsetOutOfRange(format!(
                "{} is past the end of the volume ({capacity_bytes} bytes)",
                self.starting_offset
            )));
        }
        if block_size == 0 {
            return Err(Error::Internal(
                "the backend reported a block size of 0".into(),
            ));
        }
        self.capacity = capacity_bytes;
        self.block_size = block_size;
        if let Some(s) = self.started.take() {
            let _ = s.send(());
        }
        Ok(())
    }

    fn range(&mut self, offset: u64, length: u64) -> Result<()> {
        let bs = self.block_size;
        if bs == 0 || !offset.is_multiple_of(bs) || !length.is_multiple_of(bs) || offset < self.end
        {
            return Err(Error::Internal(format!(
                "the backend reported range {offset}+{length}, not whole blocks of {bs} in order"
            )));
        }
        let end = offset.saturating_add(length);
        self.end = end;
        // The first block that ends after the starting offset.
        let first = offset.max(self.starting_offset / bs * bs);
        let mut at = first;
        while at < end {
            self.buf.push(csi::BlockMetadata {
                byte_offset: i64_of(at),
                size_bytes: i64_of(bs),
            });
            if self.buf.len() == self.max_results {
                self.send()?;
            }
            at += bs;
        }
        Ok(())
    }
}

impl<B: Backend> ControllerService<B> {
    /// Runs `run` against the backend on the blocking pool, streaming what it finds; answers
    /// with the backend's error when it fails before it began (see the module doc).
    async fn stream<T: MetadataMessage>(
        &self,
        rpc: &'static str,
        req: MetadataRequest,
        secrets: Secrets,
        run: impl FnOnce(&B, &MetadataRequest, &mut dyn MetadataSink) -> Result<()> + Send + 'static,
    ) -> Result<Response<MetadataStream<T>>, Status> {
        let backend = Arc::clone(&self.backend);
        let subject = trunc(&req.snapshot_id).to_string();
        let start = Instant::now();
        let (tx, rx) = mpsc::channel(CHANNEL_DEPTH);
        let (started_tx, started_rx) = oneshot::channel();
        let (failed_tx, failed_rx) = oneshot::channel::<Status>();
        let task = tokio::task::spawn_blocking(move || {
            let mut sink = StreamSink::new(tx.clone(), started_tx, &req);
            let result = secrets::scope(secrets, || {
                run(&backend, &req, &mut sink)?;
                sink.finish()
            });
            let micros = u64::try_from(start.elapsed().as_micros()).unwrap_or(u64::MAX);
            match result {
                Ok(()) => info!(rpc, subject, micros, messages = sink.sent, "ok"),
                Err(e) => {
                    let status = Status::from(e);
                    warn!(rpc, subject, micros, code = ?status.code(), message = status.message(), "failed");
                    if sink.started.is_some() {
                        // Not begun: the handler answers with it.
                        let _ = failed_tx.send(status);
                    } else {
                        let _ = tx.blocking_send(Err(status));
                    }
                }
            }
        });
        tokio::select! {
            biased;
            Ok(status) = failed_rx => Err(status),
            r = started_rx => match r {
                Ok(()) => {
                    let stream = tokio_stream::wrappers::ReceiverStream::new(rx);
                    Ok(Response::new(Box::pin(stream) as MetadataStream<T>))
                }
                // The task ended without beginning: it failed (or panicked).
                Err(_) => match task.await {
                    Err(e) => {
                        warn!(rpc, error = %e, "handler panicked");
                        Err(Error::Internal(format!("{rpc} panicked; see the controller log")).into())
                    }
                    Ok(()) => Err(Error::Internal(format!("{rpc} ended without an answer")).into()),
                },
            },
        }
    }
}

#[tonic::async_trait]
impl<B: Backend> csi::snapshot_metadata_server::SnapshotMetadata for ControllerService<B> {
    type GetMetadataAllocatedStream = MetadataStream<csi::GetMetadataAllocatedResponse>;
    type GetMetadataDeltaStream = MetadataStream<csi::GetMetadataDeltaResponse>;

    async fn get_metadata_allocated(
        &self,
        request: Request<csi::GetMetadataAllocatedRequest>,
    ) -> Result<Response<Self::GetMetadataAllocatedStream>, Status> {
        let req = request.into_inner();
        let secrets = Secrets::from_map(&req.secrets);
        let checked = validate::metadata_allocated(&req).map_err(Status::from)?;
        self.stream("GetMetadataAllocated", checked, secrets, |b, r, sink| {
            b.snapshot_allocated(&r.snapshot_id, r.starting_offset, sink)
        })
        .await
    }

    async fn get_metadata_delta(
        &self,
        request: Request<csi::GetMetadataDeltaRequest>,
    ) -> Result<Response<Self::GetMetadataDeltaStream>, Status> {
        let req = request.into_inner();
        let secrets = Secrets::from_map(&req.secrets);
        let checked = validate::metadata_delta(&req).map_err(Status::from)?;
        self.stream("GetMetadataDelta", checked, secrets, |b, r, sink| {
            let base = r.base_snapshot_id.as_deref().unwrap_or_default();
            b.snapshot_delta(base, &r.snapshot_id, r.starting_offset, sink)
        })
        .await
    }
}
