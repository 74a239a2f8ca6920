//! One layer's hot buffer: `hot_slots` device slots of entries, then `max_selection` staging
//! rows for a step's misses, with which position each slot holds and the step it was last
//! selected in (LRU).

use gpuio_api::DeviceBuffer;
use std::collections::HashMap;

pub(super) struct HotLayer {
    pub(super) buf: DeviceBuffer,
    slot_of: HashMap<u64, u32>,
    holder: Vec<Option<u64>>,
    /// The step each slot was last selected in (0: never).
    last_used: Vec<u64>,
}

/// Where a selection's entries come from in the layer's buffer.
pub(super) struct Plan {
    /// Per selected entry: its slot, or its staging row.
    pub(super) rows: Vec<u64>,
    /// Distinct positions missing, in staging-row order.
    pub(super) misses: Vec<u64>,
    /// Selected entries found in a slot.
    pub(super) hits: usize,
}

impl HotLayer {
    pub(super) fn new(buf: DeviceBuffer, slots: usize) -> Self {
        Self {
            buf,
            slot_of: HashMap::new(),
            holder: vec![None; slots],
            last_used: vec![0; slots],
        }
    }

    /// Entries held.
    pub(super) fn len(&self) -> usize {
        self.slot_of.len()
    }

    /// Forgets `pos` (its entry changed).
    pub(super) fn drop_entry(&mut self, pos: u64) {
        if let Some(slot) = self.slot_of.remove(&pos) {
            self.holder[slot as usize] = None;
            self.last_used[slot as usize] = 0;
        }
    }

    /// Marks the selection's hits used in `step`; the rows to read each entry from.
    pub(super) fn plan(&mut self, selection: &[u64], step: u64) -> Plan {
        let slots = self.holder.len() as u64;
        let mut plan = Plan {
            rows: Vec::with_capacity(selection.len()),
            misses: Vec::new(),
            hits: 0,
        };
        let mut staged: HashMap<u64, u64> = HashMap::new();
        for &pos in selection {
            if let Some(&slot) = self.slot_of.get(&pos) {
                self.last_used[slot as usize] = step;
                plan.hits += 1;
                plan.rows.push(slot as u64);
            } else {
                let row = *staged.entry(pos).or_insert_with(|| {
                    plan.misses.push(pos);
                    slots + plan.misses.len() as u64 - 1
                });
                plan.rows.push(row);
            }
        }
        plan
    }

    /// Gives `misses` (staged in this order) the slots selected longest ago, never one
    /// `step` selected; returns where each slot's entry comes from in the rebuilt buffer (its
    /// own row, or a staging row). There are always enough such slots: a step selects at most
    /// as many entries as there are slots.
    pub(super) fn install(&mut self, misses: &[u64], step: u64) -> Vec<u64> {
        let slots = self.holder.len();
        let mut victims: Vec<usize> = (0..slots).filter(|&s| self.last_used[s] != step).collect();
        victims.select_nth_unstable_by_key(misses.len() - 1, |&s| self.last_used[s]);
        victims.truncate(misses.len());
        let mut source: Vec<u64> = (0..slots as u64).collect();
        for (j, (&slot, &pos)) in victims.iter().zip(misses).enumerate() {
            source[slot] = (slots + j) as u64;
            if let Some(old) = self.holder[slot].replace(pos) {
                self.slot_of.remove(&old);
            }
            self.slot_of.insert(pos, slot as u32);
            self.last_used[slot] = step;
        }
        source
    }
}
