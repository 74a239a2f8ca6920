//! One layer's hot buffer: `hot_slots` device slots of entries, with which position each slot
//! holds and the step it was last selected in (LRU). Positions map to slots through a table indexed by position (a lookup
//! per selected entry is one load, not a hash).

use gpuio_api::DeviceBuffer;

/// No slot, no miss.
const NONE: u32 = u32::MAX;

pub(super) struct HotLayer {
    pub(super) buf: DeviceBuffer,
    /// By position: its slot, or `NONE`.
    slot_of: Vec<u32>,
    /// By position, during `plan` only: its place among the misses, or `NONE`.
    missing: Vec<u32>,
    holder: Vec<Option<u64>>,
    /// The step each slot was last selected in (0: never).
    last_used: Vec<u64>,
    held: usize,
}

/// Where a selection's entries come from.
pub(super) struct Plan {
    /// Per selected entry: its slot, or the number of slots plus its place among the misses.
    pub(super) rows: Vec<u64>,
    /// Distinct positions missing, in order of first selection.
    pub(super) misses: Vec<u64>,
    /// Selected entries found in a slot.
    pub(super) hits: usize,
}

impl HotLayer {
    pub(super) fn new(buf: DeviceBuffer, slots: usize) -> Self {
        Self {
            buf,
            slot_of: Vec::new(),
            missing: Vec::new(),
            holder: vec![None; slots],
            last_used: vec![0; slots],
            held: 0,
        }
    }

    /// Entries held.
    pub(super) fn len(&self) -> usize {
        self.held
    }

    /// Forgets `pos` (its entry changed).
    pub(super) fn drop_entry(&mut self, pos: u64) {
        if let Some(&slot) = self.slot_of.get(pos as usize)
            && slot != NONE
        {
            self.slot_of[pos as usize] = NONE;
            self.holder[slot as usize] = None;
            self.last_used[slot as usize] = 0;
            self.held -= 1;
        }
    }

    /// Marks the selection's hits used in `step`; the rows to read each entry from. A
    /// position at or past `len`, the layer's length, is refused (`Err` with it), the tables
    /// as they were but for the hits' recency: callers check the selection first, but one
    /// Python lends may change while it is read.
    pub(super) fn plan(&mut self, selection: &[u64], step: u64, len: u64) -> Result<Plan, u64> {
        if self.slot_of.len() < len as usize {
            self.slot_of.resize(len as usize, NONE);
            self.missing.resize(len as usize, NONE);
        }
        let slots = self.holder.len() as u64;
        let mut plan = Plan {
            rows: Vec::with_capacity(selection.len()),
            misses: Vec::new(),
            hits: 0,
        };
        let mut past = None;
        for &pos in selection {
            if pos >= len {
                past = Some(pos);
                break;
            }
            let p = pos as usize;
            let slot = self.slot_of[p];
            if slot != NONE {
                self.last_used[slot as usize] = step;
                plan.hits += 1;
                plan.rows.push(slot as u64);
            } else {
                if self.missing[p] == NONE {
                    self.missing[p] = plan.misses.len() as u32;
                    plan.misses.push(pos);
                }
                plan.rows.push(slots + self.missing[p] as u64);
            }
        }
        for &pos in &plan.misses {
            self.missing[pos as usize] = NONE;
        }
        match past {
            Some(pos) => Err(pos),
            None => Ok(plan),
        }
    }

    /// Gives `misses` (in this order) the slots selected longest ago, never one
    /// `step` selected; returns each miss's slot. There are always enough such slots: a step
    /// selects at most as many entries as there are slots.
    ///
    /// The HAL's device-planned load (`gpuio_ai_device::swap_in`) evicts by the same rule, in
    /// its install kernel and its host twin; it stays a second implementation because it must
    /// match that kernel bit for bit (ages capped at 255 steps, ties to the lower slot) over a
    /// state in device memory, while this one keeps exact steps over tables it also edits
    /// (`drop_entry`).
    pub(super) fn install(&mut self, misses: &[u64], step: u64) -> Vec<u64> {
        let slots = self.holder.len();
        let mut victims: Vec<usize> = (0..slots).filter(|&s| self.last_used[s] != step).collect();
        victims.select_nth_unstable_by_key(misses.len() - 1, |&s| self.last_used[s]);
        victims.truncate(misses.len());
        for (&slot, &pos) in victims.iter().zip(misses) {
            match self.holder[slot].replace(pos) {
                Some(old) => self.slot_of[old as usize] = NONE,
                None => self.held += 1,
            }
            self.slot_of[pos as usize] = slot as u32;
            self.last_used[slot] = step;
        }
        victims.into_iter().map(|s| s as u64).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_position_past_the_layer_is_refused_and_leaves_no_miss_marked() {
        let session = gpuio_api::Session::new(gpuio_api::Config::default()).unwrap();
        let mut hot = HotLayer::new(session.alloc_device(0, 64).unwrap(), 4);
        assert_eq!(hot.plan(&[1, 2], 1, 8).unwrap().misses, vec![1, 2]);
        assert_eq!(hot.plan(&[3, 9, 4], 2, 8).err(), Some(9));
        // The refused plan's miss (3) was unmarked: the next plan numbers its misses from 0.
        let again = hot.plan(&[3, 4, 3], 3, 8).unwrap();
        assert_eq!(again.misses, vec![3, 4]);
        assert_eq!(again.rows, vec![4, 5, 4]);
    }
}
