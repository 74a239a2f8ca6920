//! The producer side of the ring protocol. A GPU thread follows it in
//! `kernels/gpuio_ring.cuh`; [`HostProducer`] follows it on host threads, with the claim counter
//! on the host, so that CI tests the protocol (and gpuio-core's proxy) without a GPU: claim a
//! ticket, wait for its slot to be free, post the request ([`HostProducer::post`]), collect its
//! completion and free the slot for the next lap ([`HostProducer::poll`], [`HostProducer::wait`]).
//! Tokens dropped before their completion are freed by later posts.

use super::layout::{
    FLAG_STAGE, INLINE_BYTES, OP_READ, OP_WRITE, RESULT_SHUT_DOWN, SLOT_DONE, SLOT_DONE_BOUNCE,
    SLOT_DONE_INLINE, inline_marker, posted_word, status_result, status_state,
};
use super::memory::{PRODUCERS_HOST, RingMemory, RingState};
use super::{Backoff, WaitPolicy, past};
use gpuio_hal::error::{HalError, Result};
use gpuio_hal::sync::MutexExt;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

impl RingMemory {
    /// The completion of `ticket`, if published: reads the result and frees the slot for the
    /// next lap (the producer's part of the protocol).
    fn finish(&self, ticket: u64) -> Option<i64> {
        self.finish_into(ticket, None)
    }

    /// Collects a completion; the bytes of a staged one go to `staged` (when given) before
    /// the slot is handed on.
    fn finish_into(&self, ticket: u64, staged: Option<&mut Vec<u8>>) -> Option<i64> {
        let s = self.slot(ticket);
        // No lap check: this ticket's POSTED was written before (by this producer, or one
        // that handed the token over), and no later lap posts before this one frees the slot,
        // so a DONE state here is this ticket's.
        let status = s.status.load(Ordering::Acquire);
        let state = status_state(status);
        if !matches!(state, SLOT_DONE | SLOT_DONE_INLINE | SLOT_DONE_BOUNCE) {
            return None;
        }
        let result = status_result(status);
        if let Some(out) = staged {
            if state == SLOT_DONE_INLINE {
                let word = s.inline_bytes.load(Ordering::Relaxed).to_ne_bytes();
                out.clear();
                out.extend_from_slice(&word[..(result.max(0) as usize).min(INLINE_BYTES)]);
            } else if state == SLOT_DONE_BOUNCE {
                let n = (result.max(0) as usize).min(self.bounce_bytes);
                // SAFETY: the slot is DONE for this ticket and not yet handed on, so its
                // consumer has finished writing the bounce buffer (its release store of DONE
                // was acquired above) and no one writes it until we free the slot below; the
                // buffer lies inside the ring's allocation, which `self` keeps alive.
                let bytes = unsafe { std::slice::from_raw_parts(self.bounce_ptr(ticket), n) };
                out.clear();
                out.extend_from_slice(bytes);
            }
        }
        // The next lap may post (release: this thread's reads of the slot come first).
        self.host_free_turns[(ticket & self.mask()) as usize]
            .store(ticket.wrapping_add(self.nslots as u64), Ordering::Release);
        Some(result)
    }

    fn abandon(&self, ticket: u64) {
        let mut list = self.abandoned.lock_unpoisoned();
        list.push(ticket);
        self.abandoned_count.store(list.len(), Ordering::Release);
    }

    /// Frees the slots of abandoned tokens whose completions have arrived, so that a token
    /// dropped unwaited does not block the ring's next lap.
    fn reap_abandoned(&self) {
        if self.abandoned_count.load(Ordering::Acquire) == 0 {
            return;
        }
        let Ok(mut list) = self.abandoned.try_lock() else {
            return;
        };
        if self.state() == RingState::Closed {
            list.clear();
        } else {
            list.retain(|&t| self.finish(t).is_none());
        }
        self.abandoned_count.store(list.len(), Ordering::Release);
    }
}

/// A request as a producer posts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingPost {
    /// [`OP_READ`] or [`OP_WRITE`].
    pub op: u32,
    /// The resource handle.
    pub resource: u32,
    /// `FLAG_*` bits.
    pub flags: u32,
    /// Byte offset in the resource.
    pub offset: u64,
    /// Bytes to move.
    pub len: u64,
    /// Device address of the destination (READ) or source (WRITE).
    pub dev_addr: u64,
}

/// Posts requests from host threads, following exactly the protocol a GPU thread follows
/// (`kernels/gpuio_ring.cuh`), with the claim counter on the host. It stands in for kernels
/// where there is no GPU (CI) and tests the protocol. Cheap to clone; clones share the ring.
///
/// A thread that waits in `post` for a free slot must not hold tokens it has not waited for
/// when the ring is full: their slots would never be freed (as on the GPU). Dropped tokens
/// are freed by later posts.
#[derive(Clone)]
pub struct HostProducer {
    ring: Arc<RingMemory>,
    wait: WaitPolicy,
}

impl fmt::Debug for HostProducer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostProducer")
            .field("ring", &self.ring)
            .field("wait", &self.wait)
            .finish()
    }
}

/// A posted request, for [`HostProducer::poll`] and [`HostProducer::wait`]. Dropped before
/// its completion was seen, its slot is freed by a later post once the completion arrives.
#[must_use = "a request's slot is freed when its completion is collected"]
pub struct RingToken {
    ring: Arc<RingMemory>,
    ticket: u64,
    done: bool,
}

impl fmt::Debug for RingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RingToken")
            .field("ticket", &self.ticket)
            .field("done", &self.done)
            .finish()
    }
}

impl RingToken {
    /// The producer ticket the request was posted under.
    pub fn ticket(&self) -> u64 {
        self.ticket
    }

    /// Whether its completion has been collected.
    pub fn is_done(&self) -> bool {
        self.done
    }
}

impl Drop for RingToken {
    fn drop(&mut self) {
        if !self.done {
            self.ring.abandon(self.ticket);
        }
    }
}

/// Turns a published result into the producer's answer.
fn outcome(result: i64) -> Result<u64> {
    match result {
        r if r >= 0 => Ok(r as u64),
        RESULT_SHUT_DOWN => Err(HalError::RingShutDown),
        code => Err(HalError::RingRequest { code }),
    }
}

impl HostProducer {
    /// A producer for `ring`. Refused if the ring's descriptor went to kernels
    /// ([`RingMemory::device`]).
    pub fn new(ring: Arc<RingMemory>) -> Result<Self> {
        ring.set_producers(PRODUCERS_HOST)?;
        Ok(Self {
            ring,
            wait: WaitPolicy::default(),
        })
    }

    /// The same producer waiting with `wait`.
    pub fn with_wait(mut self, wait: WaitPolicy) -> Self {
        self.wait = wait;
        self
    }

    /// The ring.
    pub fn ring(&self) -> &Arc<RingMemory> {
        &self.ring
    }

    /// Posts a request: claims a ticket, waits for its slot to be free (back-pressure while
    /// the ring is full), writes the request and marks it posted. Refused with
    /// [`HalError::RingShutDown`] (nothing posted) once the ring is not open.
    pub fn post(&self, req: &RingPost) -> Result<RingToken> {
        self.post_staging(req, None)
    }

    /// Posts `req`, first putting `stage` (a staged WRITE's bytes, at most the bounce
    /// buffer's size) into its slot's bounce buffer.
    fn post_staging(&self, req: &RingPost, stage: Option<&[u8]>) -> Result<RingToken> {
        let ring = &self.ring;
        if let Some(bytes) = stage
            && bytes.len() > ring.bounce_bytes
        {
            return Err(HalError::InvalidArgument(format!(
                "{} staged bytes do not fit a bounce buffer of {}",
                bytes.len(),
                ring.bounce_bytes
            )));
        }
        let ticket = ring.host_claim.0.fetch_add(1, Ordering::Relaxed);
        let s = ring.slot(ticket);
        let free_turn = &ring.host_free_turns[(ticket & ring.mask()) as usize];
        let mut backoff = Backoff::new(&self.wait);
        loop {
            // Header first: nothing is posted after this producer saw the ring stop.
            if !ring.is_open() {
                return Err(HalError::RingShutDown);
            }
            // The slot's free turn (the GPU keeps it in its own memory, not in the slot).
            if free_turn.load(Ordering::Acquire) == ticket {
                break;
            }
            if backoff.sleeping() {
                ring.reap_abandoned();
            }
            backoff.snooze();
        }
        if let Some(bytes) = stage {
            // SAFETY: the slot's free turn is this ticket's (acquired from the release of the
            // producer that collected the previous lap, after its last read of the slot), so
            // nobody reads or writes its bounce buffer until the POSTED store below (the
            // consumer reads it after acquiring that); the buffer lies inside the ring's
            // allocation, which `ring` keeps alive, and holds `bytes` (checked above).
            unsafe {
                std::ptr::copy_nonoverlapping(bytes.as_ptr(), ring.bounce_ptr(ticket), bytes.len())
            };
        }
        s.op.store(req.op, Ordering::Relaxed);
        s.resource.store(req.resource, Ordering::Relaxed);
        s.flags.store(req.flags, Ordering::Relaxed);
        s.offset.store(req.offset, Ordering::Relaxed);
        s.len.store(req.len, Ordering::Relaxed);
        s.dev_addr.store(req.dev_addr, Ordering::Relaxed);
        s.turn.store(ticket, Ordering::Relaxed);
        s.inline_bytes
            .store(inline_marker(ticket), Ordering::Relaxed);
        // The release store orders the fields (and staged bytes) before POSTED.
        s.status.store(posted_word(ticket), Ordering::Release);
        Ok(RingToken {
            ring: ring.clone(),
            ticket,
            done: false,
        })
    }

    /// Posts a READ: `len` bytes of `resource` from `offset` to device address `dst`.
    pub fn post_read(&self, resource: u32, offset: u64, len: u64, dst: u64) -> Result<RingToken> {
        self.post(&RingPost {
            op: OP_READ,
            resource,
            flags: 0,
            offset,
            len,
            dev_addr: dst,
        })
    }

    /// Posts a WRITE: `len` bytes from device address `src` to `resource` at `offset`.
    pub fn post_write(&self, resource: u32, offset: u64, len: u64, src: u64) -> Result<RingToken> {
        self.post(&RingPost {
            op: OP_WRITE,
            resource,
            flags: 0,
            offset,
            len,
            dev_addr: src,
        })
    }

    /// Collects the completion if it has arrived: `Ok(Some(bytes))`, `Ok(None)` while
    /// pending, [`HalError::RingRequest`] for a failed request, [`HalError::RingShutDown`] if
    /// the ring shut down before serving it. A completed token cannot be polled again.
    pub fn poll(&self, token: &mut RingToken) -> Result<Option<u64>> {
        self.poll_into(token, None)
    }

    fn poll_into(
        &self,
        token: &mut RingToken,
        mut staged: Option<&mut Vec<u8>>,
    ) -> Result<Option<u64>> {
        if token.done {
            return Err(HalError::InvalidArgument(format!(
                "ring token {} was already completed",
                token.ticket
            )));
        }
        if !Arc::ptr_eq(&token.ring, &self.ring) {
            return Err(HalError::InvalidArgument(
                "ring token of another ring".into(),
            ));
        }
        if let Some(result) = self.ring.finish_into(token.ticket, staged.as_deref_mut()) {
            token.done = true;
            return outcome(result).map(Some);
        }
        if self.ring.state() == RingState::Closed {
            // The sweep happened before CLOSED; look once more, then it never comes.
            token.done = true;
            return match self.ring.finish_into(token.ticket, staged) {
                Some(result) => outcome(result).map(Some),
                None => Err(HalError::RingShutDown),
            };
        }
        Ok(None)
    }

    /// Waits for the completion (up to `timeout`; `None` waits until it arrives or the ring
    /// closes). On [`HalError::TimedOut`] the token is still pending and can be waited again.
    pub fn wait(&self, token: &mut RingToken, timeout: Option<Duration>) -> Result<u64> {
        self.wait_into(token, timeout, None)
    }

    fn wait_into(
        &self,
        token: &mut RingToken,
        timeout: Option<Duration>,
        mut staged: Option<&mut Vec<u8>>,
    ) -> Result<u64> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut backoff = Backoff::new(&self.wait);
        loop {
            if let Some(bytes) = self.poll_into(token, staged.as_deref_mut())? {
                return Ok(bytes);
            }
            if past(deadline) {
                return Err(HalError::TimedOut {
                    what: "waiting for a ring completion",
                    after: timeout.unwrap_or_default(),
                });
            }
            backoff.snooze();
        }
    }

    /// Reads `len` bytes of `resource` at `offset` the way kernels do where the ring has
    /// bounce buffers ([`FLAG_STAGE`]): delivered in the slot's bounce buffer and copied out
    /// by the producer, here into the returned vector.
    pub fn read_staged(
        &self,
        resource: u32,
        offset: u64,
        len: u64,
        timeout: Option<Duration>,
    ) -> Result<Vec<u8>> {
        let mut token = self.post(&RingPost {
            op: OP_READ,
            resource,
            flags: FLAG_STAGE,
            offset,
            len,
            dev_addr: 0,
        })?;
        let mut out = Vec::new();
        let bytes = self.wait_into(&mut token, timeout, Some(&mut out))?;
        if out.len() as u64 != bytes {
            return Err(HalError::InvalidArgument(format!(
                "a staged read of {bytes} bytes came back with {} in its bounce buffer",
                out.len()
            )));
        }
        Ok(out)
    }

    /// A blocking READ: posts it and waits for it (up to `timeout`).
    pub fn read(
        &self,
        resource: u32,
        offset: u64,
        len: u64,
        dst: u64,
        timeout: Option<Duration>,
    ) -> Result<u64> {
        let mut token = self.post_read(resource, offset, len, dst)?;
        self.wait(&mut token, timeout)
    }

    /// A blocking staged WRITE: `bytes` go to `resource` at `offset` through the slot's
    /// bounce buffer (as a GPU thread's `gpuio_write` of a small range does).
    pub fn write_staged(
        &self,
        resource: u32,
        offset: u64,
        bytes: &[u8],
        timeout: Option<Duration>,
    ) -> Result<u64> {
        let req = RingPost {
            op: OP_WRITE,
            resource,
            flags: FLAG_STAGE,
            offset,
            len: bytes.len() as u64,
            dev_addr: 0,
        };
        let mut token = self.post_staging(&req, Some(bytes))?;
        self.wait(&mut token, timeout)
    }

    /// A blocking WRITE: posts it and waits for it (up to `timeout`).
    pub fn write(
        &self,
        resource: u32,
        offset: u64,
        len: u64,
        src: u64,
        timeout: Option<Duration>,
    ) -> Result<u64> {
        let mut token = self.post_write(resource, offset, len, src)?;
        self.wait(&mut token, timeout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{SECOND, ring};
    use crate::{RingOp, Take, result_of};
    use gpuio_hal::error::ErrorCode;

    /// Serves every request on this thread with `result = len`, until the ring stops.
    fn echo_consumer(ring: Arc<RingMemory>) -> std::thread::JoinHandle<u64> {
        std::thread::spawn(move || {
            let mut served = 0;
            let mut claim = ring.claim();
            loop {
                match claim.take(&WaitPolicy::default(), None) {
                    Take::Taken(t) => {
                        let len = t.request().len as i64;
                        t.complete(len);
                        served += 1;
                        claim = ring.claim();
                    }
                    Take::Pending(c) => claim = c,
                    Take::Stopped => return served,
                }
            }
        })
    }

    #[test]
    fn requests_round_trip_with_back_pressure() {
        let r = ring(2);
        let consumer = echo_consumer(r.clone());
        let p = HostProducer::new(r.clone()).unwrap();
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let p = p.clone();
                std::thread::spawn(move || {
                    for i in 1..=200u64 {
                        let len = t * 1000 + i;
                        assert_eq!(p.read(1, 0, len, 0, Some(10 * SECOND)).unwrap(), len);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        r.begin_shutdown();
        assert_eq!(consumer.join().unwrap(), 800);
        assert_eq!(r.sweep(SECOND).unwrap(), 0);
        r.close(SECOND).unwrap();
        assert!(matches!(
            p.post_read(1, 0, 1, 0),
            Err(HalError::RingShutDown)
        ));
    }

    #[test]
    fn poll_is_non_blocking_and_one_shot() {
        let r = ring(4);
        let p = HostProducer::new(r.clone()).unwrap();
        let mut tok = p.post_write(3, 10, 20, 0x40).unwrap();
        assert_eq!(p.poll(&mut tok).unwrap(), None);
        let err = p
            .wait(&mut tok, Some(Duration::from_millis(5)))
            .unwrap_err();
        assert!(matches!(err, HalError::TimedOut { .. }), "{err}");
        let Take::Taken(t) = r.claim().try_take() else {
            panic!("posted")
        };
        let req = *t.request();
        assert_eq!(req.operation(), Some(RingOp::Write));
        assert_eq!(
            (req.resource, req.offset, req.len, req.dev_addr),
            (3, 10, 20, 0x40)
        );
        t.complete(result_of(ErrorCode::NotFound));
        let err = p.poll(&mut tok).unwrap_err();
        assert!(matches!(err, HalError::RingRequest { code: -4 }), "{err}");
        assert_eq!(err.code(), ErrorCode::NotFound);
        assert!(tok.is_done());
        assert!(
            p.poll(&mut tok).is_err(),
            "a completed token is not polled twice"
        );
        // The slot went back to its producer's next lap; it keeps the completion until then.
        assert_eq!(r.host_free_turns[0].load(Ordering::Acquire), 4);
        let view = r.slot_view(0).unwrap();
        assert_eq!((view.turn, view.state, view.result), (0, SLOT_DONE, -4));
    }

    #[test]
    fn dropped_tokens_do_not_wedge_the_ring() {
        let r = ring(2);
        let consumer = echo_consumer(r.clone());
        let p = HostProducer::new(r.clone()).unwrap();
        for i in 0..50u64 {
            drop(p.post_read(1, 0, i + 1, 0).unwrap());
        }
        assert_eq!(p.read(1, 0, 7, 0, Some(10 * SECOND)).unwrap(), 7);
        r.begin_shutdown();
        assert_eq!(consumer.join().unwrap(), 51);
    }

    #[test]
    fn a_request_posted_after_the_sweep_ends_with_the_shutdown_error() {
        let r = ring(4);
        let p = HostProducer::new(r.clone()).unwrap();
        let mut late = p.post_read(1, 0, 8, 0).unwrap();
        // Simulates the race: posted while the host was between its sweep and CLOSED
        // (here: the sweep is skipped), so nobody ever completes it.
        r.close(SECOND).unwrap();
        let err = p.wait(&mut late, None).unwrap_err();
        assert!(matches!(err, HalError::RingShutDown), "{err}");
    }

    #[test]
    fn producers_waiting_for_a_slot_are_released_by_shutdown() {
        let r = ring(2);
        let p = HostProducer::new(r.clone()).unwrap();
        let held: Vec<_> = (0..2).map(|_| p.post_read(1, 0, 8, 0).unwrap()).collect();
        let waiter = {
            let p = p.clone();
            std::thread::spawn(move || p.post_read(1, 0, 8, 0).map(|_| ()))
        };
        std::thread::sleep(Duration::from_millis(20));
        r.begin_shutdown();
        assert!(matches!(
            waiter.join().unwrap(),
            Err(HalError::RingShutDown)
        ));
        assert_eq!(r.sweep(SECOND).unwrap(), 2);
        r.close(SECOND).unwrap();
        for mut t in held {
            assert!(matches!(p.wait(&mut t, None), Err(HalError::RingShutDown)));
        }
    }
}
