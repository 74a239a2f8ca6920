//! A device-planned load as the host runs it, step for step what the fetch and the install
//! kernels do (`kernels/ai.cu`), and the report words both leave: a failure word per job (the
//! smallest of its failures) and a count word.

use super::{NONE, PENDING, SwapInFault, SwapInLoad, SwapInRefused};
use gpuio_hal::gpu::TieredSource;

/// The fetch's mark on a hit's slot word (slots are below 2^13; NONE and PENDING carry it).
pub(super) const SEL: u32 = 1 << 30;
/// Ages are counted up to this many steps.
const OLDEST: u32 = 255;
/// The failures, in the order the first is reported.
pub(super) const PAST_LEN: u64 = 0;
pub(super) const TWICE: u64 = 1;
pub(super) const TOO_MANY: u64 = 2;
pub(super) const EXHAUSTED: u64 = 3;
pub(super) const CORRUPT: u64 = 4;

/// The refusal a failure word names.
pub(super) fn plan_failure(word: u64, loads: &[SwapInLoad]) -> SwapInRefused {
    let (kind, job, value) = (word >> 60, (word >> 32) & 0x0fff_ffff, word & 0xffff_ffff);
    let load = loads.get(job as usize);
    let fault = match kind {
        EXHAUSTED | CORRUPT => SwapInFault::State,
        _ => SwapInFault::Selection,
    };
    let why = match kind {
        PAST_LEN => format!(
            "job {job}: selection entry {value} is at or past the layer's length ({:?})",
            load.map(|l| l.len)
        ),
        TWICE => format!("job {job}: position {value} is selected twice"),
        TOO_MANY => format!("job {job}: {value} selected, more than the table allows"),
        EXHAUSTED => {
            format!("job {job}: the state has run out of steps (2^32 - 1 loads and prefetches)")
        }
        CORRUPT if value == u64::from(NONE) => format!(
            "job {job}: an earlier load found a slot holding a position outside the state's \
             table and installed nothing (the state was written by something other than \
             this HAL's loads; reset it)"
        ),
        CORRUPT => format!(
            "job {job}: its state names a slot or position outside its tables, or a slot that \
             holds another position (written by something other than this HAL's loads; reset \
             it)"
        ),
        _ => format!("job {job}: unknown swap-in failure {word:#x}"),
    };
    SwapInRefused { fault, why }
}

/// A report word naming one failure (the kernel's `gpuio_swap_bad`).
pub(super) fn failure(kind: u64, job: usize, value: u64) -> u64 {
    kind << 60 | (job as u64) << 32 | (value & 0xffff_ffff)
}

/// What one job's load on the host works on besides its state, selection and codes.
pub(super) struct HostPlan {
    pub(super) positions: usize,
    pub(super) slots: usize,
    /// The layer's length this call.
    pub(super) len: u64,
    pub(super) warm_first: u64,
    /// The job's place in the call (for its failure word).
    pub(super) job: usize,
    /// The selection entry the plan's first is (the count, for a prefetch): failure words
    /// name entries by their place in the whole selection.
    pub(super) first_entry: u64,
    /// The call's count and entries ahead together, which a refusal of the whole job names
    /// (as the kernels do, in either phase).
    pub(super) want: u64,
}

/// One job's load on the host, step for step what the fetch and the install do on the
/// device: writes the codes of `selection` into `codes` (a hit's slot; a miss's warm row and
/// the slot it takes, or none where the install found the state bad) and updates `state`;
/// returns `(hits, misses)`, or the smallest failure word (the kernels keep the minimum too).
pub(super) fn plan_on_host(
    state: &mut [u32],
    selection: &[u32],
    codes: &mut [u64],
    plan: &HostPlan,
) -> std::result::Result<(usize, usize), u64> {
    let HostPlan {
        positions,
        slots,
        len,
        warm_first,
        job,
        first_entry,
        want,
    } = *plan;
    let (head, tables) = state.split_at_mut(2);
    let (slot_of, rest) = tables.split_at_mut(positions);
    let (holder, last_used) = rest.split_at_mut(slots);
    // Refused before anything is marked (a count past the table never reaches here).
    if head[0] == NONE {
        return Err(failure(EXHAUSTED, job, want));
    }
    if head[1] != 0 {
        return Err(failure(CORRUPT, job, u64::from(NONE)));
    }
    let step = head[0] + 1;
    // The fetch: every entry looked up and marked.
    let mut worst = u64::MAX;
    let mut bad = |kind, value| worst = worst.min(failure(kind, job, value));
    for (i, &pos) in selection.iter().enumerate() {
        if u64::from(pos) >= len {
            bad(PAST_LEN, first_entry + i as u64);
            continue;
        }
        let old = slot_of[pos as usize];
        if old != NONE && old != PENDING && (old & !SEL) as usize >= slots {
            bad(CORRUPT, u64::from(pos));
        } else if old == NONE {
            slot_of[pos as usize] = PENDING;
        } else if old == PENDING || old & SEL != 0 {
            bad(TWICE, u64::from(pos));
        } else {
            slot_of[pos as usize] = old | SEL;
            // Loads keep slot_of[p] = s exactly when holder[s] = p: a slot holding another
            // position (or two positions naming one slot) is the state's fault.
            if holder[old as usize] != pos {
                bad(CORRUPT, u64::from(pos));
            }
        }
    }
    // The install: hits unmarked and used this step; misses in selection order.
    let refused = worst != u64::MAX;
    let (mut hits, mut misses) = (0usize, Vec::new());
    let mut hit = vec![false; slots];
    for (i, &pos) in selection.iter().enumerate() {
        let Some(mark) = slot_of
            .get_mut(pos as usize)
            .filter(|_| u64::from(pos) < len)
        else {
            continue;
        };
        if *mark == PENDING {
            if refused {
                *mark = NONE;
            } else {
                misses.push((pos, i));
            }
        } else if *mark & SEL != 0 && ((*mark & !SEL) as usize) < slots {
            *mark &= !SEL;
            let s = *mark as usize;
            last_used[s] = step;
            hit[s] = true;
            hits += 1;
            codes[i] = s as u64;
        }
    }
    head[0] = step;
    if refused {
        return Err(worst);
    }
    let m = misses.len();
    let victims = victims(last_used, &hit, step, m);
    // A victim's position is followed: one outside the table leaves the misses read but not
    // installed, and flags the state so that its next load is refused.
    let flagged = victims
        .iter()
        .any(|&s| holder[s] != NONE && holder[s] as usize >= positions);
    for (&s, &(pos, i)) in victims.iter().zip(&misses) {
        let install = if flagged {
            slot_of[pos as usize] = NONE;
            None
        } else {
            if holder[s] != NONE {
                slot_of[holder[s] as usize] = NONE;
            }
            holder[s] = pos;
            slot_of[pos as usize] = s as u32;
            last_used[s] = step;
            Some(s as u64)
        };
        codes[i] = TieredSource::Warm {
            row: warm_first + u64::from(pos),
            install,
        }
        .code()
        .unwrap_or(u64::MAX);
    }
    head[1] = u32::from(flagged);
    Ok((hits, m))
}

/// The `m` slots the misses of step `step` take: the unselected slots (`hit` false) selected
/// longest ago (ages capped at [`OLDEST`]; among equal ages, lower slots first), in slot
/// order.
///
/// gpuio-ai's KV pool (`kv/hot.rs`, `HotLayer::install`) evicts by the same rule on the host;
/// the two stay apart because this one is the install kernel's, step for step (ages capped to
/// fit its histogram, ties to the lower slot), so that the host backend leaves the very state
/// the GPU does, while the pool's keeps exact steps over tables it also rewrites in place.
fn victims(last_used: &[u32], hit: &[bool], step: u32, m: usize) -> Vec<usize> {
    if m == 0 {
        return Vec::new();
    }
    let age = |lu: u32| step.wrapping_sub(lu).min(OLDEST) as usize;
    let mut by_age = [0usize; OLDEST as usize + 1];
    for (s, &lu) in last_used.iter().enumerate() {
        if !hit[s] {
            by_age[age(lu)] += 1;
        }
    }
    // The youngest age the victims reach, and how many unselected slots are older.
    let (mut edge, mut older) = (0, 0);
    for a in (0..by_age.len()).rev() {
        if older + by_age[a] >= m {
            edge = a;
            break;
        }
        older += by_age[a];
    }
    let mut at_edge = 0;
    (0..last_used.len())
        .filter(|&s| !hit[s])
        .filter(|&s| match age(last_used[s]).cmp(&edge) {
            std::cmp::Ordering::Greater => true,
            std::cmp::Ordering::Equal => {
                at_edge += 1;
                at_edge <= m - older
            }
            std::cmp::Ordering::Less => false,
        })
        .collect()
}

/// u32 words of a job's state (see [`swap_in_state_len`](super::swap_in_state_len)).
pub(super) fn state_words(positions: u64, slots: usize) -> usize {
    2 + positions as usize + 2 * slots
}
