//! The consumer side of the ring protocol, run by host proxy threads (gpuio-core's
//! `RingProxy`): claim the next ticket ([`RingMemory::claim`]), take the request posted under it
//! ([`RingClaim::take`]), carry it out and complete it ([`RingTaken::complete`], or
//! [`RingTaken::complete_staged`] through the slot's bounce buffer); and the host's shutdown:
//! stop ([`RingMemory::begin_shutdown`]), sweep what nobody will serve ([`RingMemory::sweep`]),
//! close ([`RingMemory::close`]).

use super::layout::{
    FLAG_STAGE, INLINE_BYTES, OP_READ, OP_WRITE, RESULT_SHUT_DOWN, RING_CLOSED, RING_OPEN,
    RING_STOPPING, SLOT_DONE, SLOT_DONE_BOUNCE, SLOT_DONE_INLINE, SLOT_POSTED, posted_word,
    status_state, status_word,
};
use super::memory::{RingMemory, RingState};
use super::{Backoff, WaitPolicy, past, result_of};
use gpuio_hal::error::{ErrorCode, HalError, Result};
use std::fmt;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

impl RingMemory {
    /// Takes the next consumer ticket: the claim is for the request posted under the same
    /// ticket. Every claim must end in a completion, unless the ring stops first.
    pub fn claim(&self) -> RingClaim<'_> {
        // SeqCst with the state loads in `take` and in `wait_consumers`: a consumer whose
        // stripe a sweep read as zero before this increment sees the ring no longer open
        // (the sweep stored STOPPING before it read the stripes).
        let stripe = gpuio_hal::sync::thread_stripe();
        self.live_claims[stripe].0.fetch_add(1, Ordering::SeqCst);
        let ticket = self.consumer_next.0.fetch_add(1, Ordering::Relaxed);
        RingClaim {
            ring: self,
            ticket,
            stripe,
        }
    }

    /// Starts the shutdown: `OPEN` → `STOPPING`. Consumers stop taking requests; producers
    /// are refused. Returns whether this call changed the state.
    pub fn begin_shutdown(&self) -> bool {
        self.header()
            .state
            .compare_exchange(RING_OPEN, RING_STOPPING, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
    }

    fn wait_consumers(&self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut backoff = Backoff::new(&WaitPolicy::default());
        while self
            .live_claims
            .iter()
            .any(|c| c.0.load(Ordering::SeqCst) != 0)
        {
            if Instant::now() >= deadline {
                return Err(HalError::TimedOut {
                    what: "waiting for the ring's consumers to finish",
                    after: timeout,
                });
            }
            backoff.snooze();
        }
        Ok(())
    }

    /// The final sweep of a stopping ring: waits (up to `timeout`) until no consumer holds a
    /// claim, then completes every slot still `POSTED` with [`RESULT_SHUT_DOWN`]. Returns how
    /// many it completed.
    pub fn sweep(&self, timeout: Duration) -> Result<usize> {
        if self.state() != RingState::Stopping {
            return Err(HalError::InvalidArgument(format!(
                "only a stopping ring is swept (this one is {:?})",
                self.state()
            )));
        }
        self.wait_consumers(timeout)?;
        let mut swept = 0;
        for s in self.slot_array() {
            // The consumers' completions happened before (live_claims), so POSTED here is a
            // request nobody serves; its producer waits and touches nothing until DONE.
            if status_state(s.status.load(Ordering::Acquire)) == SLOT_POSTED {
                s.status
                    .store(status_word(SLOT_DONE, RESULT_SHUT_DOWN), Ordering::Release);
                swept += 1;
            }
        }
        Ok(swept)
    }

    /// Ends the ring: stops it if still open, waits (up to `timeout`) until no consumer holds
    /// a claim, and stores `CLOSED`; the host writes the ring no more. Producers still waiting
    /// for a completion that never came get the shutdown error. Sweep before closing so that
    /// requests posted before the shutdown get their completions.
    pub fn close(&self, timeout: Duration) -> Result<()> {
        self.begin_shutdown();
        self.wait_consumers(timeout)?;
        self.header().state.store(RING_CLOSED, Ordering::SeqCst);
        Ok(())
    }
}

/// What a request asks for, copied out of its slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingRequest {
    /// The ticket it was posted under.
    pub ticket: u64,
    /// [`OP_READ`] or [`OP_WRITE`] (anything else is the producer's error).
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

impl RingRequest {
    /// The operation, if it is one this version knows.
    pub fn operation(&self) -> Option<RingOp> {
        match self.op {
            OP_READ => Some(RingOp::Read),
            OP_WRITE => Some(RingOp::Write),
            _ => None,
        }
    }
}

/// A ring request's direction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RingOp {
    /// Resource → device memory.
    Read,
    /// Device memory → resource.
    Write,
}

/// A consumer ticket: the right to take (and the duty to complete) the request posted under
/// the same ticket. Dropping it without taking gives the ticket up, which only a stopping ring
/// may afford.
#[must_use = "a claimed ticket is served by no one else"]
pub struct RingClaim<'r> {
    ring: &'r RingMemory,
    ticket: u64,
    /// The live-claim stripe it counts in.
    stripe: usize,
}

impl fmt::Debug for RingClaim<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RingClaim")
            .field("ticket", &self.ticket)
            .finish()
    }
}

impl Drop for RingClaim<'_> {
    fn drop(&mut self) {
        // SeqCst (a release): the completion written before this is visible to the sweep and
        // close that see the count reach zero.
        self.ring.live_claims[self.stripe]
            .0
            .fetch_sub(1, Ordering::SeqCst);
    }
}

/// The outcome of taking a claimed request.
#[must_use]
#[derive(Debug)]
pub enum Take<'r> {
    /// The request: carry it out and complete it.
    Taken(RingTaken<'r>),
    /// Not posted yet (the non-blocking form, or the deadline passed): the claim is kept.
    Pending(RingClaim<'r>),
    /// The ring is stopping: the claim is given up and its request is left to the sweep.
    Stopped,
}

impl<'r> RingClaim<'r> {
    /// The consumer ticket.
    pub fn ticket(&self) -> u64 {
        self.ticket
    }

    /// Takes the request if it has been posted, without waiting.
    pub fn try_take(self) -> Take<'r> {
        if !self.ring.is_open() {
            return Take::Stopped;
        }
        let s = self.ring.slot(self.ticket);
        // One acquire load: POSTED under this ticket. A POSTED of an earlier lap, still
        // waiting for its own consumer, carries that lap's ticket (a separate turn word, read
        // after it, could already show this lap's while its POSTED had not landed).
        if s.status.load(Ordering::Acquire) != posted_word(self.ticket) {
            return Take::Pending(self);
        }
        // Ordered after the acquire load of POSTED, so these are the producer's values.
        let request = RingRequest {
            ticket: self.ticket,
            op: s.op.load(Ordering::Relaxed),
            resource: s.resource.load(Ordering::Relaxed),
            flags: s.flags.load(Ordering::Relaxed),
            offset: s.offset.load(Ordering::Relaxed),
            len: s.len.load(Ordering::Relaxed),
            dev_addr: s.dev_addr.load(Ordering::Relaxed),
        };
        Take::Taken(RingTaken {
            claim: self,
            request,
            result: result_of(ErrorCode::General),
            staged: false,
            inline: None,
        })
    }

    /// Waits for the request (or the ring's shutdown, or `deadline`).
    pub fn take(self, wait: &WaitPolicy, deadline: Option<Instant>) -> Take<'r> {
        let mut claim = self;
        let mut backoff = Backoff::new(wait);
        loop {
            match claim.try_take() {
                Take::Pending(c) if !past(deadline) => claim = c,
                other => return other,
            }
            backoff.snooze();
        }
    }
}

/// A request taken by a consumer. [`complete`](Self::complete) publishes its result;
/// dropping it uncompleted (e.g. in a panic) publishes `GPUIO_ERROR_GENERAL`, so the
/// producer never waits for a completion that cannot come.
#[must_use = "the producer waits for this request's completion"]
pub struct RingTaken<'r> {
    // Dropped after `Drop::drop` published the result, so the sweep never races it.
    claim: RingClaim<'r>,
    request: RingRequest,
    result: i64,
    staged: bool,
    /// The bytes of an inline completion ([`SLOT_DONE_INLINE`]).
    inline: Option<u64>,
}

impl fmt::Debug for RingTaken<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RingTaken")
            .field("request", &self.request)
            .finish()
    }
}

impl RingTaken<'_> {
    /// The request.
    pub fn request(&self) -> &RingRequest {
        &self.request
    }

    /// Publishes `result` (bytes moved, ≥ 0, or a negative code) and hands the slot back to
    /// its producer.
    pub fn complete(mut self, result: i64) {
        self.result = result;
    }

    /// The slot's bounce buffer, where a READ asking for [`FLAG_STAGE`] may be delivered
    /// (then [`complete_staged`](Self::complete_staged)) and where a staged WRITE's bytes
    /// are (`None` if the request did not ask or the ring has none).
    pub fn bounce(&mut self) -> Option<&mut [u8]> {
        let ring = self.claim.ring;
        if self.request.flags & FLAG_STAGE == 0 || ring.bounce_bytes == 0 {
            return None;
        }
        // SAFETY: the buffer lies inside the ring's allocation (alive as long as the ring
        // this borrows). While a consumer holds the request taken, nothing else touches its
        // slot's bounce buffer: the producer wrote a staged WRITE's bytes before POSTED
        // (acquired when the request was taken) and reads a READ's only after DONE
        // (published when this is dropped, after the returned borrow of `self` ended), and
        // other tickets use other slots.
        Some(unsafe {
            std::slice::from_raw_parts_mut(ring.bounce_ptr(self.claim.ticket), ring.bounce_bytes)
        })
    }

    /// Publishes `bytes` delivered in the slot's bounce buffer ([`SLOT_DONE_BOUNCE`]). Up to
    /// [`INLINE_BYTES`] of them travel in the slot itself ([`SLOT_DONE_INLINE`]), read with the
    /// completion: the producer needs no second read of host memory.
    pub fn complete_staged(mut self, bytes: u64) {
        self.result = bytes.min(i64::MAX as u64) as i64;
        self.staged = true;
        let n = bytes as usize;
        if n <= INLINE_BYTES
            && let Some(b) = self.bounce().and_then(|b| b.get(..n))
        {
            let mut word = [0u8; INLINE_BYTES];
            word[..n].copy_from_slice(b);
            self.inline = Some(u64::from_ne_bytes(word));
        }
    }
}

impl Drop for RingTaken<'_> {
    fn drop(&mut self) {
        let s = self.claim.ring.slot(self.claim.ticket);
        let state = match self.inline {
            Some(word) => {
                s.inline_bytes.store(word, Ordering::Relaxed);
                SLOT_DONE_INLINE
            }
            None if self.staged && self.result > 0 => SLOT_DONE_BOUNCE,
            None => SLOT_DONE,
        };
        // One store publishes the state and the result (the inline bytes before it).
        s.status
            .store(status_word(state, self.result), Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::HostProducer;
    use crate::testing::{SECOND, ring};

    #[test]
    fn a_consumer_takes_only_its_own_laps_post() {
        // Two slots, consumers of tickets 0, 1 and 2 waiting at once: tickets 0 and 2 share
        // slot 0. Ticket 0 is posted; the producer of ticket 2 has written the slot's turn
        // (it does before its POSTED) but its POSTED has not landed.
        let r = ring(2);
        let p = HostProducer::new(r.clone()).unwrap();
        let _t0 = p.post_read(1, 0, 8, 0).unwrap();
        let (c0, c1, c2) = (r.claim(), r.claim(), r.claim());
        assert_eq!(c2.ticket(), 2);
        r.slot(2).turn.store(2, Ordering::Relaxed);
        assert!(
            matches!(c2.try_take(), Take::Pending(_)),
            "ticket 2 must not take ticket 0's request"
        );
        assert!(matches!(c1.try_take(), Take::Pending(_)));
        let Take::Taken(t) = c0.try_take() else {
            panic!("ticket 0 was posted")
        };
        t.complete(8);
    }

    #[test]
    fn a_dropped_taken_request_completes_with_an_error() {
        let r = ring(2);
        let p = HostProducer::new(r.clone()).unwrap();
        let mut tok = p.post_read(1, 0, 8, 0).unwrap();
        match r.claim().try_take() {
            Take::Taken(t) => drop(t),
            other => panic!("{other:?}"),
        }
        let err = p.wait(&mut tok, Some(SECOND)).unwrap_err();
        assert_eq!(err.code(), ErrorCode::General, "{err}");
    }

    #[test]
    fn shutdown_sweeps_posted_requests_and_refuses_new_ones() {
        let r = ring(4);
        let p = HostProducer::new(r.clone()).unwrap();
        let mut a = p.post_read(1, 0, 8, 0).unwrap();
        let mut b = p.post_read(1, 0, 8, 0).unwrap();
        // A consumer holding a request keeps the sweep waiting until it completes.
        let Take::Taken(held) = r.claim().try_take() else {
            panic!("posted")
        };
        assert!(r.sweep(SECOND).is_err(), "an open ring is not swept");
        assert!(r.begin_shutdown());
        assert!(!r.begin_shutdown());
        assert!(matches!(r.claim().try_take(), Take::Stopped));
        assert!(matches!(
            r.sweep(Duration::from_millis(20)),
            Err(HalError::TimedOut { .. })
        ));
        held.complete(8);
        assert_eq!(r.sweep(SECOND).unwrap(), 1);
        assert!(matches!(
            p.post_read(1, 0, 8, 0),
            Err(HalError::RingShutDown)
        ));
        r.close(SECOND).unwrap();
        assert_eq!(r.state(), RingState::Closed);
        assert!(r.sweep(SECOND).is_err(), "a closed ring is not written");
        assert_eq!(p.wait(&mut a, Some(SECOND)).unwrap(), 8);
        let err = p.wait(&mut b, Some(SECOND)).unwrap_err();
        assert!(matches!(err, HalError::RingShutDown), "{err}");
        assert_eq!(err.code(), ErrorCode::Canceled);
    }
}
