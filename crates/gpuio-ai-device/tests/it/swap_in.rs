//! Device-planned loads at the HAL (`ai::swap_in`) on the probed backend — the kernels on
//! the GPU machine, `plan_on_host` in CI — through states corrupted between loads: a slot
//! holding a position outside its table is found by the install after the rows went out (the
//! load's rows are right, nothing is installed, and the next load is refused until the state
//! is reset); a position naming a slot that holds another position refuses the load as the
//! state's fault, never giving it the other position's row. Rows of many pieces and of odd
//! sizes arrive whole, from slots and from host memory. gpuio-ai's swap-in tests check the
//! loads themselves against an LRU model.

use gpuio_ai_device::{
    SwapInCounts, SwapInFault, SwapInJob, SwapInLoad, SwapInRefused, SwapInTable, swap_in,
    swap_in_reset, swap_in_state_len, swap_in_table,
};
use gpuio_hal::{
    BackendPreference, DeviceBuffer, HostAllocOptions, HostBuffer, Stream, pattern, probe,
};
use gpuio_testkit::Requirement;

const POSITIONS: u64 = 16;
const SLOTS: usize = 2;

struct Rig {
    row: usize,
    stream: Stream,
    warm: HostBuffer,
    state: DeviceBuffer,
    selection: DeviceBuffer,
    dst: DeviceBuffer,
    table: SwapInTable,
}

impl Rig {
    /// A job of rows of `row` bytes.
    fn new(row: usize) -> Self {
        let mut p = probe(BackendPreference::Auto).unwrap();
        if !p.cuda.available {
            Requirement::Cuda.missing(format_args!(
                "CUDA is unavailable: {} (running on the host backend)",
                p.cuda.detail
            ));
        }
        let gpu = p.gpus.remove(0);
        let stream = gpu.stream().unwrap();
        let mut warm =
            HostBuffer::alloc_pinned(POSITIONS as usize * row, &HostAllocOptions::default(), &gpu)
                .unwrap();
        pattern::fill(&mut warm, 0, 21);
        let hot = gpu.alloc(SLOTS * row).unwrap();
        let state = gpu
            .alloc(swap_in_state_len(POSITIONS, SLOTS).unwrap())
            .unwrap();
        let selection = gpu.alloc(8).unwrap();
        let dst = gpu.alloc(2 * row).unwrap();
        swap_in_reset(&stream, &state, POSITIONS, SLOTS).unwrap();
        let job = SwapInJob {
            hot: &hot,
            slots: SLOTS,
            state: &state,
            positions: POSITIONS,
            warm: &warm,
            warm_first: 0,
            selection: &selection,
            max_count: 2,
            dst: &dst,
            dst_offset: 0,
        };
        let table = swap_in_table(&stream, row, &[job]).unwrap();
        Self {
            row,
            stream,
            warm,
            state,
            selection,
            dst,
            table,
        }
    }

    /// Loads `sel`; the job's outcome, and whether its rows arrived (where it loaded).
    fn load(&mut self, sel: &[u32]) -> Result<SwapInCounts, SwapInRefused> {
        let bytes: Vec<u8> = sel.iter().flat_map(|p| p.to_le_bytes()).collect();
        self.stream.upload(&bytes, &self.selection, 0).unwrap();
        let load = SwapInLoad {
            len: POSITIONS,
            count: sel.len(),
            ahead: 0,
        };
        let done = swap_in(&self.stream, &mut self.table, &[&self.warm], &[load], false).unwrap();
        let outcome = done.jobs[0].clone();
        if outcome.is_ok() {
            let row = self.row;
            let mut got = vec![0u8; sel.len() * row];
            self.stream.download(&self.dst, 0, &mut got).unwrap();
            for (i, &p) in sel.iter().enumerate() {
                let p = p as usize;
                assert_eq!(
                    got[i * row..(i + 1) * row],
                    self.warm[p * row..(p + 1) * row],
                    "{row}-byte rows: entry {i}, position {p}"
                );
            }
        }
        outcome
    }

    /// Writes u32 word `at` of the state, once the last install is done.
    fn corrupt(&mut self, at: usize, value: u32) {
        self.table.wait().unwrap();
        self.stream
            .upload(&value.to_le_bytes(), &self.state, 4 * at)
            .unwrap();
    }

    fn state(&mut self) -> Vec<u32> {
        self.table.wait().unwrap();
        let mut raw = vec![0u8; self.state.len()];
        self.stream.download(&self.state, 0, &mut raw).unwrap();
        raw.chunks_exact(4)
            .map(|w| u32::from_le_bytes(w.try_into().unwrap()))
            .collect()
    }

    fn reset(&mut self) {
        self.table.wait().unwrap();
        swap_in_reset(&self.stream, &self.state, POSITIONS, SLOTS).unwrap();
    }
}

/// u32 word of the state that holds position `p`'s slot, and slot `s`'s position.
fn slot_of(p: usize) -> usize {
    2 + p
}
fn holder(s: usize) -> usize {
    2 + POSITIONS as usize + s
}

#[test]
fn a_victim_outside_its_table_flags_the_state_after_the_rows_went_out() {
    let mut rig = Rig::new(64);
    // Positions 3 and 5 miss into slots 0 and 1.
    assert_eq!(rig.load(&[3]).unwrap().misses, 1);
    assert_eq!(rig.load(&[5]).unwrap().misses, 1);
    // Slot 0 (the oldest) now "holds" position 99 of 16.
    rig.corrupt(holder(0), 99);
    assert_eq!(
        rig.load(&[7]).unwrap().misses,
        1,
        "the load went through, rows right"
    );
    let st = rig.state();
    assert_eq!(st[1], 1, "the state is flagged");
    assert_eq!(
        st[slot_of(7)],
        u32::MAX,
        "position 7 got no slot: nothing installed"
    );
    assert_eq!(st[slot_of(5)], 1, "position 5 keeps its slot");
    let refused = rig.load(&[5]).unwrap_err();
    assert_eq!(refused.fault, SwapInFault::State, "{refused}");
    assert!(refused.to_string().contains("an earlier load"), "{refused}");
    // Reset, the state loads again from nothing.
    rig.reset();
    assert_eq!(rig.load(&[7]).unwrap().misses, 1);
}

#[test]
fn a_slot_holding_another_position_is_the_states_fault_never_its_row() {
    // Rows of one warp's chunk and of nine (4100 bytes as four-byte pieces): no chunk copies
    // a row from a slot that holds another position.
    for row in [64, 4100] {
        slot_holding_another_position(row);
    }
}

fn slot_holding_another_position(row: usize) {
    let mut rig = Rig::new(row);
    assert_eq!(rig.load(&[3, 5]).unwrap().misses, 2);
    // Position 9 "is" in slot 0, which holds position 3: refused alone or beside 3.
    rig.corrupt(slot_of(9), 0);
    for sel in [&[9u32][..], &[3, 9]] {
        rig.stream
            .upload(&vec![0xa5; 2 * row], &rig.dst, 0)
            .unwrap();
        let refused = rig.load(sel).unwrap_err();
        assert_eq!(refused.fault, SwapInFault::State, "{refused}");
        assert!(
            refused.to_string().contains("another position"),
            "{refused}"
        );
        let mut got = vec![0u8; 2 * row];
        rig.stream.download(&rig.dst, 0, &mut got).unwrap();
        let at = (sel.len() - 1) * row;
        assert!(
            got[at..at + row].iter().all(|&b| b == 0xa5),
            "{row}-byte rows: position 9's entry was written"
        );
    }
    // A word past the slots is refused and left as it is.
    rig.corrupt(slot_of(9), 0xbfff_fffe);
    let refused = rig.load(&[9, 9]).unwrap_err();
    assert_eq!(refused.fault, SwapInFault::State, "{refused}");
    assert_eq!(rig.state()[slot_of(9)], 0xbfff_fffe);
    // The other positions were left as they were: 3 and 5 still hit.
    assert_eq!(rig.load(&[5, 3]).unwrap().hits, 2);
}

#[test]
fn rows_of_many_pieces_and_odd_sizes_arrive_whole_from_slots_and_host_memory() {
    // 4100 bytes move as 1025 four-byte pieces, 2051 as single bytes, 4096 as 256 sixteen-byte
    // ones, 24 as three eight-byte ones: a warp's entry takes one round of pieces or many.
    for row in [4100, 2051, 4096, 24] {
        let mut rig = Rig::new(row);
        let refused = rig.load(&[5, 5]).unwrap_err();
        assert_eq!(refused.fault, SwapInFault::Selection, "{row}: {refused}");
        assert_eq!(rig.load(&[3, 5]).unwrap().misses, 2, "{row}");
        let both = rig.load(&[5, 3]).unwrap();
        assert_eq!((both.hits, both.misses), (2, 0), "{row}");
        let mixed = rig.load(&[7, 5]).unwrap();
        assert_eq!((mixed.hits, mixed.misses), (1, 1), "{row}");
    }
}

#[test]
fn a_prefetch_installs_rows_of_many_chunks_whole_and_delivers_none() {
    // 4100-byte rows move as nine chunks of four-byte pieces, a warp each; 64-byte rows as
    // one. Position 3 is loaded and 5 prefetched after it: 5's row reaches no destination
    // row, lands whole in its slot, and the next load finds both there.
    for row in [4100, 64] {
        let mut rig = Rig::new(row);
        let bytes: Vec<u8> = [3u32, 5].iter().flat_map(|p| p.to_le_bytes()).collect();
        rig.stream.upload(&bytes, &rig.selection, 0).unwrap();
        rig.stream
            .upload(&vec![0xa5; 2 * row], &rig.dst, 0)
            .unwrap();
        let load = SwapInLoad {
            len: POSITIONS,
            count: 1,
            ahead: 1,
        };
        let warm = [&rig.warm];
        let done = swap_in(&rig.stream, &mut rig.table, &warm, &[load], false).unwrap();
        assert_eq!(done.jobs[0].clone().unwrap().misses, 1, "{row}");
        let pre = rig.table.prefetched().unwrap().expect("a prefetch ran");
        assert_eq!(pre[0].clone().unwrap().misses, 1, "{row}");
        let mut got = vec![0u8; 2 * row];
        rig.stream.download(&rig.dst, 0, &mut got).unwrap();
        assert_eq!(
            got[..row],
            rig.warm[3 * row..4 * row],
            "{row}: the loaded row"
        );
        assert!(
            got[row..].iter().all(|&b| b == 0xa5),
            "{row}: the prefetched row was delivered"
        );
        // Rig::load checks every row it delivers: 5's comes from the slot the prefetch filled.
        let both = rig.load(&[5, 3]).unwrap();
        assert_eq!((both.hits, both.misses), (2, 0), "{row}");
        // Nothing ahead: no prefetch to report.
        rig.load(&[3]).unwrap();
        assert!(rig.table.prefetched().unwrap().is_none());
    }
}
