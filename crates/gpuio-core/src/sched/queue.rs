//! The ready queue: the scheduler's ordering decisions as a plain, single-threaded data
//! structure (the scheduler wraps it in its lock), so that its invariants can be tested as a
//! state machine without threads.
//!
//! One `EngineQueue` per transport (the per-engine queues of docs/REFERENCE.md#layers: MemIO,
//! LocalIO, RemoteIO). Inside each, work waits in one of three places:
//! - the **deadline queues**: requests with a deadline, earliest deadline first (DEADLINE and
//!   ADAPTIVE policies), one heap per class so that a lease's floor holds back only its own
//!   classes' heads;
//! - six **class queues** (docs/REFERENCE.md#priority-classes); inside a class, each session is a
//!   *flow*, and flows share the class CFS-style: the flow with the least virtual runtime
//!   (bytes served / session weight) goes next, and a flow that wakes up starts at the class's
//!   minimum, so idling banks no credit;
//! - a plain arrival-order queue under FIFO.
//!
//! Every pop compares the heads by [`Rank`]: an *aged* class (waiting longer than `max_wait`
//! while other work ran) first, which bounds every class's wait; then deadlines; then classes
//! (strictly by class under PRIORITY and DEADLINE, by weighted fair share under ADAPTIVE).

use crate::request::Priority;
use crate::route::EngineKind;
use serde::{Deserialize, Serialize};
use std::cmp::{Ordering, Reverse};
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::time::{Duration, Instant};

/// How the scheduler orders work (`gpuio_sched_policy_t`; docs/REFERENCE.md#scheduling).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Policy {
    /// Arrival order; classes and deadlines are ignored.
    Fifo,
    /// Strict priority classes; CFS fairness across sessions inside a class.
    Priority,
    /// Earliest deadline first for requests with a deadline, then PRIORITY for the rest.
    #[default]
    Deadline,
    /// Deadline requests just in time (EDF once their deadline is within `urgent_window`);
    /// otherwise classes share the engines by weight instead of strictly.
    Adaptive,
}

impl std::str::FromStr for Policy {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "fifo" => Ok(Self::Fifo),
            "priority" => Ok(Self::Priority),
            "deadline" => Ok(Self::Deadline),
            "adaptive" => Ok(Self::Adaptive),
            _ => Err(format!(
                "unknown scheduling policy {s:?} (fifo, priority, deadline, adaptive)"
            )),
        }
    }
}

/// Identity of a scheduling session (a tenant sharing the engines).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct SessionId(pub u64);

/// What the queue knows of a unit of work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Meta {
    /// Arrival order (assigned by [`ReadyQueue::push`]).
    pub seq: u64,
    /// The session it belongs to.
    pub session: SessionId,
    /// The session's fair-share weight (≥ 1).
    pub weight: u32,
    /// Priority class.
    pub class: Priority,
    /// Deadline, if any.
    pub deadline: Option<Instant>,
    /// The engine that will run it.
    pub engine: EngineKind,
    /// Bytes it moves.
    pub cost: u64,
    /// When it was queued.
    pub arrival: Instant,
}

/// The ordering parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QueueConfig {
    /// The policy.
    pub policy: Policy,
    /// A non-empty class that has not been served for this long goes next (starvation bound).
    pub max_wait: Duration,
    /// ADAPTIVE: a deadline this close counts as urgent.
    pub urgent_window: Duration,
}

impl Default for QueueConfig {
    fn default() -> Self {
        Self {
            policy: Policy::default(),
            max_wait: Duration::from_millis(20),
            urgent_window: Duration::from_millis(2),
        }
    }
}

/// Why a unit goes next; smaller ranks first. The variant order is the policy: aged classes,
/// then (urgent) deadlines, then classes, then lax deadlines; FIFO uses arrival alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Rank {
    /// A class starving since this instant.
    Aged(Instant, u8),
    /// A deadline request (earliest first).
    Deadline(Instant, u64),
    /// A class head: (class key, flow virtual runtime, arrival).
    Class(u64, u64, u64),
    /// ADAPTIVE: a deadline request that is not yet urgent.
    Lax(Instant, u64),
    /// FIFO: arrival order.
    Fifo(u64),
}

/// Every request also costs this much virtual time, so floods of tiny requests are charged.
const REQUEST_COST: u64 = 4096;

/// ADAPTIVE class weights, most urgent first.
const CLASS_WEIGHTS: [u64; 6] = [32, 16, 8, 4, 2, 1];

fn scaled(cost: u64, weight: u64) -> u64 {
    (cost.saturating_add(REQUEST_COST)).saturating_mul(1024) / weight.max(1)
}

struct Entry<T> {
    meta: Meta,
    item: T,
}

/// Min-heap entry by (deadline, seq).
struct ByDeadline<T>(Entry<T>);

impl<T> ByDeadline<T> {
    fn key(&self) -> (Instant, u64) {
        (
            self.0.meta.deadline.unwrap_or(self.0.meta.arrival),
            self.0.meta.seq,
        )
    }
}

impl<T> PartialEq for ByDeadline<T> {
    fn eq(&self, other: &Self) -> bool {
        self.key() == other.key()
    }
}
impl<T> Eq for ByDeadline<T> {}
impl<T> PartialOrd for ByDeadline<T> {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl<T> Ord for ByDeadline<T> {
    fn cmp(&self, other: &Self) -> Ordering {
        // BinaryHeap is a max-heap: reverse for earliest first.
        other.key().cmp(&self.key())
    }
}

struct Flow<T> {
    entries: VecDeque<Entry<T>>,
    vruntime: u64,
}

/// One priority class: its sessions' flows, shared CFS-style.
struct ClassQueue<T> {
    /// Keyed by small counters on every push and pop: a fast hash, not SipHash.
    flows: HashMap<SessionId, Flow<T>, foldhash::fast::RandomState>,
    /// Active (non-empty) flows by (vruntime, head arrival, session).
    active: BinaryHeap<Reverse<(u64, u64, SessionId)>>,
    min_vruntime: u64,
    /// ADAPTIVE: this class's virtual time.
    vtime: u64,
    /// Since when the class has waited: last served, or became non-empty.
    waiting_since: Option<Instant>,
    len: usize,
}

impl<T> Default for ClassQueue<T> {
    fn default() -> Self {
        Self {
            flows: HashMap::default(),
            active: BinaryHeap::new(),
            min_vruntime: 0,
            vtime: 0,
            waiting_since: None,
            len: 0,
        }
    }
}

impl<T> ClassQueue<T> {
    fn push(&mut self, e: Entry<T>) {
        let sid = e.meta.session;
        let min = self.min_vruntime;
        let flow = self.flows.entry(sid).or_insert_with(|| Flow {
            entries: VecDeque::new(),
            vruntime: min,
        });
        if flow.entries.is_empty() {
            flow.vruntime = flow.vruntime.max(min);
            self.active.push(Reverse((flow.vruntime, e.meta.seq, sid)));
        }
        if self.len == 0 {
            self.waiting_since = Some(e.meta.arrival);
        }
        flow.entries.push_back(e);
        self.len += 1;
    }

    /// The head's (flow vruntime, arrival).
    fn head(&self) -> Option<(u64, u64)> {
        self.active.peek().map(|Reverse((v, seq, _))| (*v, *seq))
    }

    fn pop(&mut self, now: Instant) -> Option<Entry<T>> {
        let Reverse((v, _, sid)) = self.active.pop()?;
        let flow = self.flows.get_mut(&sid)?;
        let e = flow.entries.pop_front()?;
        self.min_vruntime = self.min_vruntime.max(v);
        flow.vruntime = v.saturating_add(scaled(e.meta.cost, e.meta.weight.into()));
        match flow.entries.front() {
            Some(next) => self
                .active
                .push(Reverse((flow.vruntime, next.meta.seq, sid))),
            // A flow at or behind the minimum would restart there anyway: forget it.
            None if flow.vruntime <= self.min_vruntime => {
                self.flows.remove(&sid);
            }
            None => {}
        }
        self.len -= 1;
        self.waiting_since = (self.len > 0).then_some(now);
        Some(e)
    }

    fn drain_session(&mut self, sid: SessionId) -> Vec<Entry<T>> {
        let Some(flow) = self.flows.remove(&sid) else {
            return Vec::new();
        };
        self.active.retain(|Reverse((_, _, s))| *s != sid);
        self.len -= flow.entries.len();
        if self.len == 0 {
            self.waiting_since = None;
        }
        flow.entries.into()
    }
}

/// Where the next unit of an engine queue comes from.
#[derive(Debug, Clone, Copy)]
enum Source {
    Fifo,
    Deadline(usize),
    Class(usize),
}

/// The queues of one engine.
struct EngineQueue<T> {
    fifo: VecDeque<Entry<T>>,
    /// Per class: the earliest deadline first across them is EDF.
    deadline: [BinaryHeap<ByDeadline<T>>; 6],
    classes: [ClassQueue<T>; 6],
    /// ADAPTIVE: the virtual time of the last class served.
    vclock: u64,
    len: usize,
}

impl<T> Default for EngineQueue<T> {
    fn default() -> Self {
        Self {
            fifo: VecDeque::new(),
            deadline: Default::default(),
            classes: Default::default(),
            vclock: 0,
            len: 0,
        }
    }
}

impl<T> EngineQueue<T> {
    fn push(&mut self, cfg: &QueueConfig, e: Entry<T>) {
        self.len += 1;
        match cfg.policy {
            Policy::Fifo => self.fifo.push_back(e),
            Policy::Deadline | Policy::Adaptive if e.meta.deadline.is_some() => {
                self.deadline[e.meta.class as usize].push(ByDeadline(e))
            }
            _ => {
                let c = e.meta.class as usize;
                let class = &mut self.classes[c];
                if class.len == 0 {
                    class.vtime = class.vtime.max(self.vclock);
                }
                class.push(e);
            }
        }
    }

    /// The best candidate and its rank. Units of a class less urgent than `floor` (a class
    /// a lease holds) are passed over until they have waited `max_wait`.
    fn best(
        &self,
        cfg: &QueueConfig,
        now: Instant,
        floor: Option<Priority>,
    ) -> Option<(Rank, Source)> {
        // Every pop asks each engine's queue; most are empty.
        if self.len == 0 {
            return None;
        }
        if cfg.policy == Policy::Fifo {
            return self
                .fifo
                .front()
                .map(|e| (Rank::Fifo(e.meta.seq), Source::Fifo));
        }
        let mut best: Option<(Rank, Source)> = None;
        let mut consider = |r: Rank, s: Source| {
            if best.is_none_or(|(b, _)| r < b) {
                best = Some((r, s));
            }
        };
        let held_back = |class: usize| floor.is_some_and(|f| class > f as usize);
        for (i, class) in self.classes.iter().enumerate() {
            let Some((v, seq)) = class.head() else {
                continue;
            };
            if let Some(since) = class.waiting_since
                && now.saturating_duration_since(since) >= cfg.max_wait
            {
                consider(Rank::Aged(since, i as u8), Source::Class(i));
            }
            if held_back(i) {
                continue;
            }
            let key = match cfg.policy {
                Policy::Adaptive => class.vtime,
                _ => i as u64,
            };
            consider(Rank::Class(key, v, seq), Source::Class(i));
        }
        for (i, heap) in self.deadline.iter().enumerate() {
            let Some(head) = heap.peek() else {
                continue;
            };
            if held_back(i) && now.saturating_duration_since(head.0.meta.arrival) < cfg.max_wait {
                continue;
            }
            let (d, seq) = head.key();
            let urgent = cfg.policy != Policy::Adaptive
                || d.saturating_duration_since(now) <= cfg.urgent_window;
            let r = if urgent {
                Rank::Deadline(d, seq)
            } else {
                Rank::Lax(d, seq)
            };
            consider(r, Source::Deadline(i));
        }
        best
    }

    fn pop_from(&mut self, src: Source, now: Instant) -> Option<Entry<T>> {
        let e = match src {
            Source::Fifo => self.fifo.pop_front(),
            Source::Deadline(i) => self.deadline[i].pop().map(|d| d.0),
            Source::Class(i) => {
                let class = &mut self.classes[i];
                let e = class.pop(now)?;
                self.vclock = self.vclock.max(class.vtime);
                class.vtime = class
                    .vtime
                    .saturating_add(scaled(e.meta.cost, CLASS_WEIGHTS[i]));
                Some(e)
            }
        }?;
        self.len -= 1;
        Some(e)
    }

    fn drain_session(&mut self, sid: SessionId) -> Vec<Entry<T>> {
        let mut out = Vec::new();
        let (keep, gone): (VecDeque<_>, VecDeque<_>) = std::mem::take(&mut self.fifo)
            .into_iter()
            .partition(|e| e.meta.session != sid);
        self.fifo = keep;
        out.extend(gone);
        for heap in &mut self.deadline {
            let (keep, gone): (Vec<_>, Vec<_>) = std::mem::take(heap)
                .into_vec()
                .into_iter()
                .partition(|d| d.0.meta.session != sid);
            *heap = keep.into();
            out.extend(gone.into_iter().map(|d| d.0));
        }
        for class in &mut self.classes {
            out.extend(class.drain_session(sid));
        }
        self.len -= out.len();
        out
    }
}

/// The scheduler's queues: one `EngineQueue` per transport.
pub struct ReadyQueue<T> {
    cfg: QueueConfig,
    engines: [EngineQueue<T>; 3],
    seq: u64,
    len: usize,
}

impl<T> std::fmt::Debug for ReadyQueue<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReadyQueue")
            .field("policy", &self.cfg.policy)
            .field("len", &self.len)
            .finish()
    }
}

fn engine_index(e: EngineKind) -> usize {
    match e {
        EngineKind::MemIo => 0,
        EngineKind::LocalIo => 1,
        EngineKind::RemoteIo => 2,
    }
}

impl<T> ReadyQueue<T> {
    /// An empty queue.
    pub fn new(cfg: QueueConfig) -> Self {
        Self {
            cfg,
            engines: Default::default(),
            seq: 0,
            len: 0,
        }
    }

    /// The ordering parameters.
    pub fn config(&self) -> &QueueConfig {
        &self.cfg
    }

    /// Units queued.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Units queued for one engine.
    pub fn engine_len(&self, engine: EngineKind) -> usize {
        self.engines[engine_index(engine)].len
    }

    /// Queues `item`; `meta.seq` is assigned here. Returns the assigned sequence number.
    pub fn push(&mut self, mut meta: Meta, item: T) -> u64 {
        self.seq += 1;
        meta.seq = self.seq;
        meta.weight = meta.weight.max(1);
        self.engines[engine_index(meta.engine)].push(&self.cfg, Entry { meta, item });
        self.len += 1;
        self.seq
    }

    /// The next unit by the policy, across the engines.
    pub fn pop(&mut self, now: Instant) -> Option<(Meta, T)> {
        self.pop_above(now, None)
    }

    /// The next unit by the policy of a class at least as urgent as `floor` (where a lease
    /// holds one), or of one that has waited `max_wait`; FIFO ignores the floor.
    pub fn pop_above(&mut self, now: Instant, floor: Option<Priority>) -> Option<(Meta, T)> {
        let (_, engine, src) = self.best(now, floor)?;
        let e = self.engines[engine].pop_from(src, now)?;
        self.len -= 1;
        Some((e.meta, e.item))
    }

    /// Whether [`pop_above`](Self::pop_above) would give a unit.
    pub fn has_eligible(&self, now: Instant, floor: Option<Priority>) -> bool {
        self.best(now, floor).is_some()
    }

    fn best(&self, now: Instant, floor: Option<Priority>) -> Option<(Rank, usize, Source)> {
        let floor = floor.filter(|_| self.cfg.policy != Policy::Fifo);
        self.engines
            .iter()
            .enumerate()
            .filter_map(|(i, q)| q.best(&self.cfg, now, floor).map(|(r, s)| (r, i, s)))
            .min_by_key(|(r, _, _)| *r)
    }

    /// Removes every unit of a session (its queued work is being cancelled).
    pub fn drain_session(&mut self, sid: SessionId) -> Vec<(Meta, T)> {
        let out: Vec<_> = self
            .engines
            .iter_mut()
            .flat_map(|q| q.drain_session(sid))
            .map(|e| (e.meta, e.item))
            .collect();
        self.len -= out.len();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(session: u64, class: Priority, deadline: Option<Instant>, cost: u64) -> Meta {
        Meta {
            seq: 0,
            session: SessionId(session),
            weight: 1,
            class,
            deadline,
            engine: EngineKind::MemIo,
            cost,
            arrival: Instant::now(),
        }
    }

    fn queue(policy: Policy) -> ReadyQueue<u32> {
        ReadyQueue::new(QueueConfig {
            policy,
            max_wait: Duration::from_secs(3600),
            urgent_window: Duration::from_millis(1),
        })
    }

    fn drain(q: &mut ReadyQueue<u32>, now: Instant) -> Vec<u32> {
        std::iter::from_fn(|| q.pop(now).map(|(_, i)| i)).collect()
    }

    #[test]
    fn fifo_is_arrival_order() {
        let mut q = queue(Policy::Fifo);
        let t = Instant::now();
        q.push(meta(1, Priority::Background, None, 1), 0);
        q.push(meta(1, Priority::InferenceRealtime, Some(t), 1), 1);
        q.push(meta(2, Priority::Checkpoint, None, 1), 2);
        assert_eq!(drain(&mut q, t), [0, 1, 2]);
    }

    #[test]
    fn priority_serves_classes_strictly() {
        let mut q = queue(Policy::Priority);
        q.push(meta(1, Priority::Background, None, 1), 0);
        q.push(meta(1, Priority::Checkpoint, None, 1), 1);
        q.push(meta(1, Priority::InferenceRealtime, None, 1), 2);
        assert_eq!(drain(&mut q, Instant::now()), [2, 1, 0]);
    }

    #[test]
    fn deadlines_go_earliest_first_and_before_classes() {
        let mut q = queue(Policy::Deadline);
        let t = Instant::now();
        q.push(meta(1, Priority::InferenceRealtime, None, 1), 0);
        q.push(
            meta(
                1,
                Priority::Background,
                Some(t + Duration::from_millis(9)),
                1,
            ),
            1,
        );
        q.push(
            meta(
                2,
                Priority::Checkpoint,
                Some(t + Duration::from_millis(3)),
                1,
            ),
            2,
        );
        assert_eq!(drain(&mut q, t), [2, 1, 0]);
    }

    #[test]
    fn sessions_share_a_class_by_bytes_served() {
        let mut q = queue(Policy::Priority);
        // Session 1 queues big units, session 2 small ones: session 2 must not wait for all
        // of session 1's bytes.
        for i in 0..4 {
            q.push(meta(1, Priority::TrainingForward, None, 1 << 20), i);
        }
        for i in 10..14 {
            q.push(meta(2, Priority::TrainingForward, None, 4096), i);
        }
        let order = drain(&mut q, Instant::now());
        let first_small = order.iter().position(|&i| i >= 10).unwrap();
        assert!(first_small <= 1, "{order:?}");
        let last_small = order.iter().rposition(|&i| i >= 10).unwrap();
        assert!(last_small <= 4, "small flow finished late: {order:?}");
    }

    #[test]
    fn an_aged_class_goes_next() {
        let mut q = ReadyQueue::new(QueueConfig {
            policy: Policy::Priority,
            max_wait: Duration::from_millis(5),
            urgent_window: Duration::ZERO,
        });
        let t = Instant::now();
        q.push(meta(1, Priority::Background, None, 1), 0);
        q.push(meta(1, Priority::InferenceRealtime, None, 1), 1);
        assert_eq!(q.pop(t).unwrap().1, 1);
        q.push(meta(1, Priority::InferenceRealtime, None, 1), 2);
        assert_eq!(q.pop(t + Duration::from_millis(6)).unwrap().1, 0);
    }

    #[test]
    fn adaptive_shares_by_weight_and_holds_lax_deadlines() {
        let mut q = queue(Policy::Adaptive);
        let t = Instant::now();
        q.push(
            meta(
                1,
                Priority::InferenceRealtime,
                Some(t + Duration::from_secs(1)),
                1,
            ),
            99,
        );
        for i in 0..40 {
            q.push(meta(1, Priority::InferenceRealtime, None, 4096), i);
            q.push(meta(2, Priority::Background, None, 4096), 100 + i);
        }
        let order = drain(&mut q, t);
        // The lax deadline request waits for the classes; the background class still gets
        // about 1/33 of the turns while the realtime class is busy.
        assert_eq!(order.last(), Some(&99));
        let bg_early = order[..40].iter().filter(|&&i| i >= 100).count();
        assert!((1..=4).contains(&bg_early), "{order:?}");
    }

    #[test]
    fn a_floor_holds_back_only_less_urgent_work_deadlines_included() {
        let mut q = queue(Policy::Deadline);
        let t = Instant::now();
        // A background unit due first, then a realtime one due later: under a realtime
        // lease's floor the realtime one goes, and the background one waits.
        q.push(
            meta(
                1,
                Priority::Background,
                Some(t + Duration::from_millis(1)),
                1,
            ),
            0,
        );
        q.push(
            meta(
                1,
                Priority::InferenceRealtime,
                Some(t + Duration::from_millis(9)),
                1,
            ),
            1,
        );
        q.push(meta(1, Priority::Checkpoint, None, 1), 2);
        let floor = Some(Priority::InferenceRealtime);
        assert!(q.has_eligible(t, floor));
        assert_eq!(q.pop_above(t, floor).map(|x| x.1), Some(1));
        assert!(!q.has_eligible(t, floor));
        assert_eq!(q.pop_above(t, floor).map(|x| x.1), None);
        // Without the floor, EDF again.
        assert_eq!(q.pop(t).map(|x| x.1), Some(0));
        assert_eq!(q.pop(t).map(|x| x.1), Some(2));
    }

    #[test]
    fn draining_a_session_removes_only_its_work() {
        let mut q = queue(Policy::Deadline);
        let t = Instant::now();
        q.push(meta(1, Priority::Background, None, 1), 0);
        q.push(meta(2, Priority::Background, None, 1), 1);
        q.push(meta(2, Priority::Checkpoint, Some(t), 1), 2);
        let gone: Vec<u32> = q
            .drain_session(SessionId(2))
            .into_iter()
            .map(|x| x.1)
            .collect();
        assert_eq!(gone.len(), 2);
        assert_eq!(q.len(), 1);
        assert_eq!(drain(&mut q, t), [0]);
    }
}
