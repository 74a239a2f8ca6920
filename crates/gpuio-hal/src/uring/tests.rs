//! Unit tests of the ring: it moves between threads; fixed reads and writes, and the errors of
//! misuse; shared buffers in a sparse table.

use super::*;
use crate::memory::{HostAllocOptions, SharedHostBuffer};

fn file_with(data: &[u8]) -> (std::path::PathBuf, Arc<File>) {
    let path = std::env::temp_dir().join(format!(
        "gpuio-ring-{}-{}",
        std::process::id(),
        crate::pattern::mix64(data.len() as u64)
    ));
    std::fs::write(&path, data).unwrap();
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .unwrap();
    (path, Arc::new(f))
}

#[test]
fn rings_can_move_between_threads() {
    fn is_send<T: Send>() {}
    is_send::<Ring>();
}

#[test]
fn fixed_reads_writes_and_errors() {
    let Ok(mut ring) = Ring::new(RingOptions::default()) else {
        eprintln!("skipped: io_uring unavailable: {}", Ring::probe().detail);
        return;
    };
    let mut data = vec![0u8; 64 << 10];
    crate::pattern::fill(&mut data, 0, 5);
    let (path, file) = file_with(&data);
    let bufs = (0..2)
        .map(|_| HostBuffer::alloc(32 << 10, &HostAllocOptions::default()).unwrap())
        .collect();
    ring.register_buffers(bufs).unwrap();
    let f = ring.register_file(file).unwrap();
    ring.read_fixed(f, 4096, BufSlot(0), 0..8192, 7).unwrap();
    assert!(ring.buffer(BufSlot(0)).is_err(), "busy while in flight");
    ring.read_fixed(f, 60 << 10, BufSlot(1), 0..8192, 8)
        .unwrap();
    let mut done = Vec::new();
    while done.len() < 2 {
        done.extend(ring.complete(1).unwrap());
    }
    done.sort_by_key(|d| d.tag);
    assert_eq!(done[0].result.as_ref().unwrap(), &8192);
    assert_eq!(
        done[1].result.as_ref().unwrap(),
        &4096,
        "short read at end of file"
    );
    let b = ring.buffer(BufSlot(0)).unwrap();
    assert_eq!(crate::pattern::first_deviation(&b[..8192], 4096, 5), None);
    // Write back through a lent-and-returned buffer.
    let lent = ring.take_buffer(BufSlot(1)).unwrap();
    assert!(ring.read_fixed(f, 0, BufSlot(1), 0..10, 9).is_err());
    ring.put_buffer(BufSlot(1), lent).unwrap();
    ring.write_fixed(f, 0, BufSlot(0), 0..100, 10).unwrap();
    ring.fsync(f, false, 11).unwrap();
    let mut n = 0;
    while n < 2 {
        for d in ring.complete(1).unwrap() {
            d.result.unwrap();
            n += 1;
        }
    }
    assert!(
        ring.read_fixed(f, 0, BufSlot(0), 0..(64 << 10), 12)
            .is_err()
    );
    assert!(
        ring.read_fixed(FileSlot(9), 0, BufSlot(0), 0..10, 13)
            .is_err()
    );
    std::fs::remove_file(path).unwrap();
}

#[test]
fn shared_buffers_in_a_sparse_table() {
    let mut ring = match Ring::with_buffer_table(RingOptions::default(), 4) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("skipped: sparse buffer tables unavailable: {e}");
            return;
        }
    };
    let mut data = vec![0u8; 32 << 10];
    crate::pattern::fill(&mut data, 0, 9);
    let (path, file) = file_with(&data);
    let f = ring.register_file(file).unwrap();
    let owner = Arc::new(SharedHostBuffer::new(
        HostBuffer::alloc(64 << 10, &HostAllocOptions::default()).unwrap(),
    ));
    assert!(ring.register_shared(owner.clone(), 60 << 10, 8192).is_err());
    assert!(ring.register_shared(owner.clone(), 0, 0).is_err());
    let idx = ring.register_shared(owner.clone(), 8192, 16384).unwrap();
    assert_eq!(ring.shared_range(idx).unwrap().1, 8192..24576);
    assert!(
        ring.register_buffers(vec![
            HostBuffer::alloc(4096, &HostAllocOptions::default()).unwrap()
        ])
        .is_err(),
        "a table ring takes no owned buffers"
    );
    ring.read_fixed_shared(f, 4096, idx, 100..8292, 1).unwrap();
    assert!(ring.read_fixed_shared(f, 0, idx, 0..16385, 2).is_err());
    let done = ring.complete(1).unwrap();
    assert_eq!(done.len(), 1);
    assert_eq!((done[0].tag, *done[0].result.as_ref().unwrap()), (1, 8192));
    {
        let buf = owner.read();
        let got = &buf[8192 + 100..8192 + 8292];
        assert_eq!(got, &data[4096..4096 + 8192]);
        assert!(
            buf[..8292].iter().all(|&b| b == 0),
            "nothing written before the range"
        );
    }
    ring.unregister_shared(idx).unwrap();
    assert!(ring.unregister_shared(idx).is_err());
    assert!(ring.read_fixed_shared(f, 0, idx, 0..10, 3).is_err());
    assert_eq!(
        Arc::strong_count(&owner),
        1,
        "the slot gave its buffer back"
    );
    // Slots are reused; a ring dropped with a registered slot releases it.
    let again = ring.register_shared(owner.clone(), 0, 4096).unwrap();
    assert_eq!(again, idx);
    // A buffer put in the registered one's place is refused by name, the same size or smaller.
    for len in [64 << 10, 2048] {
        *owner.write() = HostBuffer::alloc(len, &HostAllocOptions::default()).unwrap();
        let e = ring.read_fixed_shared(f, 0, again, 0..4096, 4).unwrap_err();
        assert!(e.to_string().contains("was replaced"), "{len}: {e}");
    }
    drop(ring);
    assert_eq!(Arc::strong_count(&owner), 1);
    std::fs::remove_file(path).unwrap();
}

#[test]
fn buffers_come_back_out_of_a_ring_after_its_operations() {
    let Ok(mut ring) = Ring::new(RingOptions::default()) else {
        eprintln!("skipped: io_uring unavailable: {}", Ring::probe().detail);
        return;
    };
    let mut data = vec![0u8; 16 << 10];
    crate::pattern::fill(&mut data, 0, 9);
    let (path, file) = file_with(&data);
    let bufs: Vec<HostBuffer> = (0..3)
        .map(|_| HostBuffer::alloc(8 << 10, &HostAllocOptions::default()).unwrap())
        .collect();
    let addrs: Vec<usize> = bufs.iter().map(|b| b.as_ptr() as usize).collect();
    ring.register_buffers(bufs).unwrap();
    let f = ring.register_file(file).unwrap();
    // One read still in flight, one buffer lent out: the read is waited for, the lent buffer
    // stays with whoever holds it.
    ring.read_fixed(f, 0, BufSlot(0), 0..8192, 1).unwrap();
    let lent = ring.take_buffer(BufSlot(2)).unwrap();
    let back = ring.unregister_buffers().unwrap();
    assert_eq!(ring.in_flight(), 0);
    assert_eq!(ring.buffers(), 0);
    let got: Vec<usize> = back.iter().map(|b| b.as_ptr() as usize).collect();
    assert_eq!(got, addrs[..2]);
    assert_eq!(
        crate::pattern::first_deviation(&back[0][..8192], 0, 9),
        None
    );
    assert!(
        ring.put_buffer(BufSlot(2), lent).is_err(),
        "no slot any more"
    );
    // The ring takes buffers again.
    ring.register_buffers(back).unwrap();
    assert_eq!(ring.buffers(), 2);
    assert!(ring.unregister_buffers().unwrap().len() == 2);
    assert!(ring.unregister_buffers().unwrap().is_empty());
    std::fs::remove_file(path).unwrap();
}
