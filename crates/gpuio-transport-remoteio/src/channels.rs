//! A peer's one-sided channels (RDMA queue pairs, NIXL links), pooled per export, and the
//! exports the agent would not serve over them: TCP serves those from then on.

use crate::connection::Connection;
use crate::{RemoteIoError, Result};
use gpuio_hal::ErrorCode;
use gpuio_hal::sync::MutexExt;
use std::collections::HashMap;
use std::sync::Mutex;

/// A channel to one export, set up over its own control connection.
pub(crate) trait Channel {
    /// The transport's name, for the log.
    const TRANSPORT: &'static str;
    /// The control connection (the agent's side of the channel lives as long as it does).
    fn control(&self) -> &Connection;
    /// Whether the channel can serve again after a call that returned `r`.
    fn reusable<T>(&self, r: &Result<T>) -> bool;
}

/// Idle channels by export, and the exports the agent refused.
pub(crate) struct ChannelPool<C> {
    idle: Mutex<HashMap<String, Vec<C>>>,
    tcp_only: Mutex<Vec<String>>,
}

impl<C> Default for ChannelPool<C> {
    fn default() -> Self {
        Self {
            idle: Mutex::new(HashMap::new()),
            tcp_only: Mutex::new(Vec::new()),
        }
    }
}

impl<C> std::fmt::Debug for ChannelPool<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChannelPool")
            .field("tcp_only", &*self.tcp_only.lock_unpoisoned())
            .finish_non_exhaustive()
    }
}

impl<C: Channel> ChannelPool<C> {
    /// Whether the agent may serve `export` over these channels (it has not refused it yet).
    pub(crate) fn may_serve(&self, export: &str) -> bool {
        !self.tcp_only.lock_unpoisoned().iter().any(|e| e == export)
    }

    /// From now on, `export` is served over TCP only (these channels failed it).
    pub(crate) fn serve_over_tcp(&self, export: &str) {
        let mut tcp_only = self.tcp_only.lock_unpoisoned();
        if !tcp_only.iter().any(|e| e == export) {
            tcp_only.push(export.to_string());
        }
    }

    /// Runs `f` on an idle channel to `export`, or on one `open` makes; a channel that cannot
    /// serve again is dropped. `None` when the export is served over TCP only (the agent
    /// answered `Unsupported`).
    pub(crate) fn run<T>(
        &self,
        export: &str,
        f: impl FnOnce(&mut C) -> Result<T>,
        open: impl FnOnce() -> Result<C>,
    ) -> Option<Result<T>> {
        if !self.may_serve(export) {
            return None;
        }
        // A channel whose control connection the agent closed (it restarted, or ended the
        // session) reaches nothing any more: the agent's side went with the session.
        let pooled = self
            .idle
            .lock_unpoisoned()
            .get_mut(export)
            .and_then(Vec::pop)
            .filter(|ch| ch.control().is_alive());
        let mut ch = match pooled.map_or_else(open, Ok) {
            Ok(ch) => ch,
            Err(RemoteIoError::Remote {
                code: ErrorCode::Unsupported,
                message,
            }) => {
                tracing::debug!(export, %message, "served over TCP: not offered over {}", C::TRANSPORT);
                self.serve_over_tcp(export);
                return None;
            }
            Err(e) => return Some(Err(e)),
        };
        let r = f(&mut ch);
        if ch.reusable(&r) {
            self.idle
                .lock_unpoisoned()
                .entry(export.to_string())
                .or_default()
                .push(ch);
        }
        Some(r)
    }
}
