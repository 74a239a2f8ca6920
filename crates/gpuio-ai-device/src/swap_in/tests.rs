//! The host's plan of a device-planned load (`plan.rs`) against worked examples and any state
//! words: victims, refusals and their faults, bounds never followed.

use super::plan::*;
use super::*;
use gpuio_hal::gpu::TieredSource;

/// A state with `positions` and `slots`, as the table resets it.
fn fresh(positions: usize, slots: usize) -> Vec<u32> {
    initial_state(positions as u64, slots)
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

fn shape(positions: usize, slots: usize, len: u64, job: usize) -> HostPlan {
    HostPlan {
        positions,
        slots,
        len,
        warm_first: 100,
        job,
        first_entry: 0,
        want: 0,
    }
}

fn run(state: &mut [u32], p: usize, s: usize, sel: &[u32], len: u64) -> (usize, usize, Vec<u64>) {
    let mut codes = vec![0; sel.len()];
    let (h, m) = plan_on_host(state, sel, &mut codes, &shape(p, s, len, 0)).expect("plan");
    (h, m, codes)
}

#[test]
fn misses_take_the_oldest_unselected_slots_in_slot_order() {
    let (p, s) = (64, 4);
    let mut st = fresh(p, s);
    // Step 1: 0, 1, 2 miss into slots 0, 1, 2 (never used: equally old, lower first).
    let (h, m, codes) = run(&mut st, p, s, &[0, 1, 2], 64);
    assert_eq!((h, m), (0, 3));
    for (i, c) in codes.iter().enumerate() {
        let want = TieredSource::Warm {
            row: 100 + i as u64,
            install: Some(i as u64),
        };
        assert_eq!(TieredSource::from_code(*c), want);
    }
    // Step 2: 1 hits; 7 takes slot 3 (never used, the oldest).
    let (h, m, codes) = run(&mut st, p, s, &[1, 7], 64);
    assert_eq!((h, m), (1, 1));
    assert_eq!(codes[0], 1);
    // Step 3: 5 and 6 miss: the oldest unselected are slots 0 and 2 (step 1); 1 and 3
    // were used in step 2 and 3 is selected now (position 7).
    let (h, m, codes) = run(&mut st, p, s, &[5, 7, 6], 64);
    assert_eq!((h, m), (1, 2));
    let slot = |c: u64| match TieredSource::from_code(c) {
        TieredSource::Warm { install, .. } => install,
        TieredSource::Hot(_) => None,
    };
    assert_eq!(
        (slot(codes[0]), codes[1], slot(codes[2])),
        (Some(0), 3, Some(2))
    );
    // Position 0 and 2 lost their slots; 1 kept its.
    let (h, m, _) = run(&mut st, p, s, &[0, 1], 64);
    assert_eq!((h, m), (1, 1));
}

#[test]
fn bad_selections_install_nothing_and_name_the_first_failure() {
    let (p, s) = (16, 8);
    let mut st = fresh(p, s);
    run(&mut st, p, s, &[3, 4], 16);
    let before: Vec<u32> = st[2..2 + p].to_vec();
    let mut codes = vec![0; 3];
    let e = plan_on_host(&mut st, &[5, 9, 5], &mut codes, &shape(p, s, 16, 2)).unwrap_err();
    assert_eq!(e, failure(TWICE, 2, 5));
    let e = plan_on_host(&mut st, &[3, 12, 1], &mut codes, &shape(p, s, 12, 0)).unwrap_err();
    assert_eq!(e, failure(PAST_LEN, 0, 1));
    let e = plan_on_host(&mut st, &[4, 4], &mut codes[..2], &shape(p, s, 16, 0)).unwrap_err();
    assert_eq!(e, failure(TWICE, 0, 4));
    assert_eq!(
        st[2..2 + p],
        before[..],
        "nothing installed or dropped, no mark left"
    );
    // The failed steps were spent: a later load sees its hits as fresh.
    let (h, m, _) = run(&mut st, p, s, &[3, 4, 5], 16);
    assert_eq!((h, m), (2, 1));
}

#[test]
fn a_state_naming_slots_past_its_tables_is_refused_not_followed() {
    let (p, s) = (8, 2);
    let mut st = fresh(p, s);
    st[2 + 3] = 7; // position 3 "in" slot 7 of 2
    let mut codes = vec![0; 1];
    let e = plan_on_host(&mut st, &[3], &mut codes, &shape(p, s, 8, 0)).unwrap_err();
    assert_eq!(e, failure(CORRUPT, 0, 3));
    assert_eq!(st[2 + 3], 7, "left as it was");
    // Slot 0 "holds" position 99 of 8: found only when slot 0 is a victim, after the
    // row went out. The load reads its misses without installing them, and flags the
    // state, whose next load is refused.
    let mut st = fresh(p, s);
    st[2 + p] = 99;
    let before = st.clone();
    let (hits, misses) = plan_on_host(&mut st, &[1], &mut codes, &shape(p, s, 8, 0)).unwrap();
    assert_eq!((hits, misses), (0, 1));
    let want = TieredSource::Warm {
        row: 101,
        install: None,
    };
    assert_eq!(TieredSource::from_code(codes[0]), want);
    assert_eq!(st[1], 1, "flagged");
    assert_eq!(st[2..], before[2..], "nothing installed");
    let e = plan_on_host(&mut st, &[1], &mut codes, &shape(p, s, 8, 0)).unwrap_err();
    assert_eq!(e, failure(CORRUPT, 0, u64::from(NONE)));
    let r = plan_failure(e, &[]);
    assert!(r.to_string().contains("an earlier load"), "{r}");
    assert_eq!(r.fault, SwapInFault::State);
}

#[test]
fn a_prefetch_names_its_failures_by_their_entry_in_the_whole_selection() {
    let (p, s) = (16, 8);
    let mut st = fresh(p, s);
    let mut codes = vec![0; 2];
    let mut ahead = shape(p, s, 12, 1);
    ahead.first_entry = 5;
    let e = plan_on_host(&mut st, &[3, 13], &mut codes, &ahead).unwrap_err();
    assert_eq!(e, failure(PAST_LEN, 1, 6));
    assert!(
        plan_failure(e, &[])
            .to_string()
            .contains("selection entry 6")
    );
}

#[test]
fn refusals_say_whether_the_selection_or_the_state_is_at_fault() {
    for (kind, fault) in [
        (PAST_LEN, SwapInFault::Selection),
        (TWICE, SwapInFault::Selection),
        (TOO_MANY, SwapInFault::Selection),
        (EXHAUSTED, SwapInFault::State),
        (CORRUPT, SwapInFault::State),
    ] {
        let r = plan_failure(failure(kind, 0, 7), &[]);
        assert_eq!(r.fault, fault, "{r}");
        assert!(r.to_string().starts_with("swap-in: job 0: "), "{r}");
    }
}

#[test]
fn an_exhausted_state_is_refused() {
    let mut st = fresh(4, 2);
    st[0] = u32::MAX;
    let mut codes = vec![0; 1];
    let e = plan_on_host(&mut st, &[0], &mut codes, &shape(4, 2, 4, 1)).unwrap_err();
    assert_eq!(e >> 60, EXHAUSTED);
    // A prefetch's refusal names the call's count and entries ahead, as the kernels do.
    let mut ahead = shape(4, 2, 4, 1);
    (ahead.first_entry, ahead.want) = (1, 2);
    let e = plan_on_host(&mut st, &[0], &mut codes, &ahead).unwrap_err();
    assert_eq!(e, failure(EXHAUSTED, 1, 2));
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

    /// Any state words and any selection (of at most as many positions as slots, as the
    /// table enforces): the load answers (a count or a failure word) without panicking,
    /// its codes name rows inside their tiers, and a refused load installs nothing and
    /// leaves no mark (only the step and its hits' last steps may change).
    #[test]
    fn any_state_and_selection_is_answered_never_followed_out_of_bounds(
        words in proptest::collection::vec(proptest::prelude::any::<u32>(), 2 + 24 + 2 * 6),
        small in proptest::collection::vec(0u32..30, 38),
        use_small in proptest::prelude::any::<bool>(),
        selection in proptest::collection::vec(0u32..30, 0..=6),
        len in 0u64..=24,
    ) {
        let (p, s) = (24, 6);
        // Random words reach the checks; small ones reach the plan's deeper steps.
        let mut st = if use_small { small } else { words };
        st[0] %= 1 << 20;
        // A flagged state is refused before anything else (a test of its own above).
        st[1] = u32::from(st[1] == 1);
        let before = st.clone();
        let mut codes = vec![u64::MAX; selection.len()];
        match plan_on_host(&mut st, &selection, &mut codes, &shape(p, s, len, 0)) {
            Ok((hits, misses)) => {
                proptest::prop_assert_eq!(hits + misses, selection.len());
                for c in codes {
                    match TieredSource::from_code(c) {
                        TieredSource::Hot(slot) => {
                            proptest::prop_assert!(slot < s as u64)
                        }
                        TieredSource::Warm { row, install } => {
                            proptest::prop_assert!(row >= 100 && row < 100 + len);
                            proptest::prop_assert!(install.is_none_or(|i| i < s as u64));
                            proptest::prop_assert_eq!(install.is_none(), st[1] == 1);
                        }
                    }
                }
            }
            Err(_) => {
                proptest::prop_assert_eq!(&st[2..2 + p + s], &before[2..2 + p + s]);
            }
        }
    }
}

#[test]
fn state_lengths_count_every_table() {
    assert_eq!(swap_in_state_len(10, 3), Some(4 * (2 + 10 + 6)));
    assert_eq!(swap_in_state_len(u64::MAX, 1), None);
}
