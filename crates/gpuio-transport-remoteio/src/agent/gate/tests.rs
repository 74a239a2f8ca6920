use super::*;

fn ip(last: u8) -> IpAddr {
    IpAddr::from([10, 0, 0, last])
}

fn evicted(p: &Pending) -> bool {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    rt.block_on(async {
        tokio::time::timeout(std::time::Duration::from_millis(2), p.evicted())
            .await
            .is_ok()
    })
}

#[test]
fn the_oldest_gives_way_per_address_then_per_prefix() {
    let gate = Gate::new(2, 3);
    let a1 = gate.admit(ip(1)).unwrap();
    let a2 = gate.admit(ip(1)).unwrap();
    // A third from the same address evicts its oldest, not another address's.
    let b1 = gate.admit(ip(2)).unwrap();
    let a3 = gate.admit(ip(1)).unwrap();
    assert!(evicted(&a1));
    assert!(!evicted(&a2) && !evicted(&b1) && !evicted(&a3));
    // Past the total, the address holding the most (10.0.0.1, with a2 and a3) gives its
    // oldest; b1, older but alone at its address, stays.
    let c1 = gate.admit(ip(3)).unwrap();
    assert!(evicted(&a2));
    assert!(!evicted(&b1) && !evicted(&c1) && !evicted(&a3));
    assert_eq!(gate.evicted(), 2);
    // IPv6 addresses of one /64 are one source; a mapped IPv4 address is that address.
    let at = |a: &str| prefixes(a.parse().unwrap())[LEVELS - 1];
    assert_eq!(at("2001:db8::1"), at("2001:db8::ffff:2"));
    assert_ne!(at("2001:db8::1"), at("2001:db8:0:1::1"));
    assert_eq!(at("::ffff:10.0.0.1"), prefixes(ip(1))[LEVELS - 1]);
    // IPv4 and IPv6 prefixes never meet.
    assert_ne!(prefixes(ip(1))[0], prefixes("::".parse().unwrap())[0]);
    // Places come back when handshakes end.
    drop((a1, a2, b1, a3, c1));
    let s = gate.state.lock().unwrap();
    assert!(s.pending.is_empty() && s.held.is_empty());
}

#[test]
fn a_silent_socket_gives_way_before_one_that_has_spoken() {
    let gate = Gate::new(3, 10);
    let spoke = gate.admit(ip(1)).unwrap();
    spoke.advance(Progress::Spoke);
    let silent = gate.admit(ip(1)).unwrap();
    let _third = gate.admit(ip(1)).unwrap();
    let _fourth = gate.admit(ip(1)).unwrap();
    assert!(evicted(&silent) && !evicted(&spoke));
}

#[test]
fn a_distributed_ipv4_flood_evicts_only_its_own_sockets() {
    let gate = Gate::new(128, 512);
    // A slow client far away, mid-TLS, and one in the attacker's own /16 but its own /20.
    let far = gate.admit(IpAddr::from([192, 168, 7, 9])).unwrap();
    far.advance(Progress::Spoke);
    let near = gate.admit(IpAddr::from([10, 1, 200, 5])).unwrap();
    near.advance(Progress::Spoke);
    // 5,000 sources over 20 /24s, round after round.
    let mut flood = Vec::new();
    for round in 0..3 {
        for i in 0..5000u32 {
            let addr = IpAddr::from([10, 1, (i / 250) as u8, (i % 250) as u8 + round]);
            flood.push(gate.admit(addr).unwrap());
        }
    }
    assert!(!evicted(&far) && !evicted(&near));
    let s = gate.state.lock().unwrap();
    assert_eq!(s.pending.len(), 512);
    // The flood's /16 holds no more than its bound.
    let sixteen = prefixes(IpAddr::from([10, 1, 0, 0]))[0];
    assert!(s.count(&sixteen) <= gate.bound(0));
}

#[test]
fn an_ipv6_flood_from_one_48_leaves_other_prefixes_alone() {
    let gate = Gate::new(128, 512);
    let good: IpAddr = "2001:db8:2::1".parse().unwrap();
    let slow = gate.admit(good).unwrap();
    slow.advance(Progress::Spoke);
    let mut flood = Vec::new();
    for i in 0..1200u16 {
        let addr: IpAddr = format!("2001:db8:1:{i:x}::7").parse().unwrap();
        flood.push(gate.admit(addr).unwrap());
    }
    assert!(!evicted(&slow));
    let s = gate.state.lock().unwrap();
    // The /48 holds no more than its bound, however many /64s it spans.
    let attacker = prefixes("2001:db8:1::".parse().unwrap())[1];
    assert_eq!(s.count(&attacker), gate.bound(1));
}

#[test]
fn a_handshake_that_made_progress_keeps_its_place_until_it_ends() {
    let gate = Gate::new(1, 2);
    let tls = gate.admit(ip(1)).unwrap();
    tls.advance(Progress::Secured);
    let hello = gate.admit(ip(2)).unwrap();
    hello.advance(Progress::Hello);
    // Nothing may give way: the newcomer is refused, and no one is evicted.
    assert!(gate.admit(ip(3)).is_none());
    assert!(gate.admit(ip(1)).is_none());
    assert_eq!((gate.refused(), gate.evicted()), (2, 0));
    assert!(!evicted(&tls) && !evicted(&hello));
    // Progress never goes backwards.
    tls.advance(Progress::Spoke);
    assert!(gate.admit(ip(3)).is_none());
    drop(tls);
    assert!(gate.admit(ip(3)).is_some());
}

#[test]
fn hellos_from_a_few_prefixes_cannot_lock_the_others_out() {
    let gate = Gate::new(128, 512);
    // Four addresses in four /16s fill every place with protected handshakes.
    let mut flood = Vec::new();
    for a in 0..4u8 {
        for _ in 0..128 {
            let p = gate.admit(IpAddr::from([10 + a, 0, 0, 1])).unwrap();
            p.advance(Progress::Hello);
            flood.push(p);
        }
    }
    // A good client elsewhere still gets a place: one of the largest prefixes' gives way.
    let slow = gate.admit(IpAddr::from([192, 168, 1, 1])).unwrap();
    slow.advance(Progress::Spoke);
    assert_eq!(gate.evicted(), 1);
    // More from the flood's addresses are refused or evict their own, never the slow one.
    for a in 0..4u8 {
        let _ = gate.admit(IpAddr::from([10 + a, 0, 0, 1]));
        let fresh = gate.admit(IpAddr::from([10 + a, 0, 0, 2]));
        if let Some(p) = fresh {
            p.advance(Progress::Hello);
            flood.push(p);
        }
    }
    // And from a fifth prefix of the flood's own.
    let _fifth = gate.admit(IpAddr::from([20, 0, 0, 1])).unwrap();
    assert!(!evicted(&slow));
}
