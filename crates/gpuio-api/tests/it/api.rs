//! The public API end to end on the probed backend: sessions, URIs, blocking / async /
//! callback / batch transfers, and `copy` (what `gpuio cp` runs).

use gpuio_api::*;
use gpuio_hal::pattern;
use gpuio_testkit::Requirement;
use std::path::Path;
use std::sync::mpsc;

fn session() -> Session {
    Session::new(Config::default()).unwrap()
}

fn patterned_file(path: &Path, len: usize, seed: u64) {
    let mut data = vec![0u8; len];
    pattern::fill(&mut data, 0, seed);
    std::fs::write(path, &data).unwrap();
}

fn no_noise(_: u64) {}

#[test]
fn blocking_async_callback_and_batch_transfers() {
    let s = session();
    let dev = s.alloc_device(0, 8 << 20).unwrap();
    let host = s
        .alloc_host(HostPlacement::Dram { numa: None }, 8 << 20, true)
        .unwrap();
    pattern::fill(&mut host.write(), 0, 31);

    // Async, awaited on tokio.
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let done = rt
        .block_on(
            s.transfer_async(Endpoint::host(&host, 0), Endpoint::device(&dev, 0), 8 << 20)
                .unwrap(),
        )
        .unwrap();
    assert_eq!(done.outcome.bytes, 8 << 20);

    // Blocking, into a plain Vec.
    let mut back = vec![0u8; 8 << 20];
    s.download(&dev, 0, &mut back).unwrap();
    assert_eq!(pattern::first_deviation(&back, 0, 31), None);

    // Callback.
    let (tx, rx) = mpsc::channel();
    let out = s
        .alloc_host(HostPlacement::Dram { numa: None }, 1 << 20, false)
        .unwrap();
    let req = Request::new(
        Endpoint::device(&dev, 1 << 20),
        Endpoint::host(&out, 0),
        1 << 20,
    )
    .unwrap()
    .with_priority(Priority::InferenceRealtime);
    s.submit_with_callback(req, move |r| tx.send(r.is_ok()).unwrap())
        .unwrap();
    assert!(rx.recv().unwrap());
    assert_eq!(pattern::first_deviation(&out.read(), 1 << 20, 31), None);

    // Batch of 128 adjacent 64 KiB device-to-host reads: one transfer.
    let sink = s
        .alloc_host(HostPlacement::Dram { numa: None }, 8 << 20, false)
        .unwrap();
    let reqs: Vec<Request> = (0..128)
        .map(|i| {
            Request::new(
                Endpoint::device(&dev, i << 16),
                Endpoint::host(&sink, i << 16),
                1 << 16,
            )
            .unwrap()
        })
        .collect();
    let report = s.submit_batch(reqs).unwrap().wait().unwrap();
    assert_eq!((report.requests, report.segments), (128, 1));
    assert_eq!(pattern::first_deviation(&sink.read(), 0, 31), None);
}

#[test]
fn uris_open_the_resources_they_name() {
    let s = session();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f");
    patterned_file(&path, 1000, 1);
    let uri = Uri::parse(&format!("file://{}", path.display())).unwrap();
    let r = s.open(&uri, 0, Access::Read).unwrap();
    assert_eq!(r.len().unwrap(), 1000);
    let r = s
        .open(&Uri::parse("gpu0").unwrap(), 4096, Access::Write)
        .unwrap();
    assert!(matches!(r, Resource::Device(ref b) if b.len() == 4096));
    let r = s
        .open(
            &Uri::parse("memio://cpu/dram?numa=0").unwrap(),
            4096,
            Access::Write,
        )
        .unwrap();
    assert!(matches!(r, Resource::Host(_)));

    let direct = s
        .open(
            &Uri::parse(&format!("localio://{}?direct=1", path.display())).unwrap(),
            0,
            Access::Read,
        )
        .unwrap();
    assert!(matches!(direct, Resource::File(ref f) if f.is_direct()));
    // RemoteIO needs a key in the configuration; RDMA is not in this build.
    let remote = |u: &str| {
        s.open(&Uri::parse(u).unwrap(), 0, Access::Read)
            .unwrap_err()
    };
    let err = remote("remoteio://10.0.0.1:5555/data");
    assert_eq!(err.code(), ErrorCode::InvalidArg, "{err}");
    assert!(err.to_string().contains("[remote] key_id"), "{err}");
    let err = remote("remoteio://10.0.0.1:5555/data?transport=rdma");
    assert_eq!(err.code(), ErrorCode::Unsupported, "{err}");
    let err = remote("remoteio://some-segment/data");
    assert!(err.to_string().contains("registry"), "{err}");
    // gds=1 asks for cuFile: it runs where cuFile can, and says why not elsewhere.
    let gds = Uri::parse(&format!("localio://{}?gds=1", path.display())).unwrap();
    let r = s.open(&gds, 0, Access::Read).unwrap();
    assert!(matches!(r, Resource::File(ref f) if f.gds() == Some(true)));
    let len = std::fs::metadata(&path).unwrap().len();
    let copied = s.copy(&gds, &Uri::Gpu(0), &Default::default(), &mut |_| {});
    match copied {
        Ok(r) => assert_eq!(r.bytes, len),
        Err(e) => {
            assert_eq!(e.code(), ErrorCode::Unsupported, "{e}");
            Requirement::Gds.missing(format_args!("cuFile: {e}"));
        }
    }
    let err = s
        .open(&Uri::parse("gpu7").unwrap(), 10, Access::Write)
        .unwrap_err();
    assert_eq!(err.code(), ErrorCode::NotFound, "{err}");
    let err = s
        .open(
            &Uri::parse("memio://cpu/dram?numa=77").unwrap(),
            10,
            Access::Write,
        )
        .unwrap_err();
    assert_eq!(err.code(), ErrorCode::NotFound, "{err}");
    let err = s
        .open(&Uri::parse("/nonexistent/x").unwrap(), 0, Access::Read)
        .unwrap_err();
    assert_eq!(err.code(), ErrorCode::NotFound, "{err}");
}

#[test]
fn copies_round_trip_through_every_tier() {
    let s = session();
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.bin");
    let len = (24 << 20) + 12345;
    patterned_file(&src, len, 5);
    let src_uri = Uri::parse(src.to_str().unwrap()).unwrap();
    for (i, via) in [None, Some("gpu0"), Some("memio://cpu/dram?numa=0")]
        .into_iter()
        .enumerate()
    {
        let dst = dir.path().join(format!("dst{i}.bin"));
        let opts = CopyOptions {
            via: via.map(|v| Uri::parse(v).unwrap()),
            verify: true,
            window: 5 << 20,
            durable: true,
        };
        let mut last = 0;
        let report = s
            .copy(
                &src_uri,
                &Uri::parse(dst.to_str().unwrap()).unwrap(),
                &opts,
                &mut |d| {
                    assert!(d > last);
                    last = d;
                },
            )
            .unwrap();
        assert_eq!(report.bytes, len as u64);
        assert_eq!(last, len as u64);
        assert!(report.checksum.is_some());
        assert_eq!(
            std::fs::read(&dst).unwrap(),
            std::fs::read(&src).unwrap(),
            "via {via:?}"
        );
    }
    // Into GPU memory: the bytes stay in the report's resource.
    let report = s
        .copy(
            &src_uri,
            &Uri::Gpu(0),
            &CopyOptions {
                verify: true,
                ..Default::default()
            },
            &mut no_noise,
        )
        .unwrap();
    let Resource::Device(dev) = &report.destination else {
        panic!("expected device memory");
    };
    let mut back = vec![0u8; len];
    s.download(dev, 0, &mut back).unwrap();
    assert_eq!(pattern::first_deviation(&back, 0, 5), None);
    // Nothing but the source and the destinations is left in the directory.
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names.len(), 4, "{names:?}");
}

#[test]
fn impossible_copies_are_typed_errors_that_leave_nothing_behind() {
    let s = session();
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.bin");
    patterned_file(&src, 1 << 20, 2);
    let src_uri = Uri::parse(src.to_str().unwrap()).unwrap();
    let dst_uri = Uri::parse(dir.path().join("out").to_str().unwrap()).unwrap();
    let copy = |a: &Uri, b: &Uri, via: Option<&str>| {
        let opts = CopyOptions {
            via: via.map(|v| Uri::parse(v).unwrap()),
            ..CopyOptions::default()
        };
        s.copy(a, b, &opts, &mut no_noise).unwrap_err()
    };
    assert_eq!(
        copy(&Uri::Gpu(0), &dst_uri, None).code(),
        ErrorCode::InvalidArg
    );
    assert_eq!(copy(&src_uri, &src_uri, None).code(), ErrorCode::InvalidArg);
    assert_eq!(
        copy(&src_uri, &dst_uri, Some("/tmp/x")).code(),
        ErrorCode::InvalidArg
    );
    assert_eq!(
        copy(&src_uri, &dst_uri, Some("gpu9")).code(),
        ErrorCode::NotFound
    );
    let missing = Uri::parse(dir.path().join("missing").to_str().unwrap()).unwrap();
    assert_eq!(copy(&missing, &dst_uri, None).code(), ErrorCode::NotFound);
    let nodir = Uri::parse(dir.path().join("no/such/dir/x").to_str().unwrap()).unwrap();
    assert_eq!(copy(&src_uri, &nodir, None).code(), ErrorCode::NotFound);
    // A full device: the error says so, and reports nothing as written.
    if Path::new("/dev/full").exists() {
        let err = copy(&src_uri, &Uri::parse("/dev/full").unwrap(), Some("gpu0"));
        assert_eq!(err.code(), ErrorCode::Io, "{err}");
        assert!(err.to_string().contains("no space"), "{err}");
    }
    assert!(!dir.path().join("out").exists());
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names.len(), 1, "temporary files left behind: {names:?}");
}

#[test]
fn concurrent_copies_to_one_destination_do_not_mix_and_modes_are_kept() {
    use std::os::unix::fs::PermissionsExt;
    let s = session();
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    patterned_file(&a, 3 << 20, 1);
    patterned_file(&b, 3 << 20, 2);
    let dst = dir.path().join("dst");
    std::fs::write(&dst, b"old").unwrap();
    std::fs::set_permissions(&dst, std::fs::Permissions::from_mode(0o640)).unwrap();
    let dst_uri = Uri::parse(dst.to_str().unwrap()).unwrap();
    std::thread::scope(|t| {
        for src in [&a, &b] {
            let (s, dst_uri) = (&s, &dst_uri);
            t.spawn(move || {
                let opts = CopyOptions {
                    window: 1 << 20,
                    ..CopyOptions::default()
                };
                s.copy(
                    &Uri::parse(src.to_str().unwrap()).unwrap(),
                    dst_uri,
                    &opts,
                    &mut no_noise,
                )
                .unwrap();
            });
        }
    });
    // The destination is exactly one of the sources, never a mixture.
    let got = std::fs::read(&dst).unwrap();
    assert!(got == std::fs::read(&a).unwrap() || got == std::fs::read(&b).unwrap());
    let mode = std::fs::metadata(&dst).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o640);
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names.len(), 3, "temporary files left behind: {names:?}");
}

#[test]
fn memio_and_localio_lanes_share_the_sessions_staging_pool() {
    // The default pool: sized automatically, its counters published from the start.
    let s = session();
    let limit = s.staging_pool().stats().limit;
    assert!(limit >= 1 << 30, "{limit}");
    // "auto" is a share of the memory the machine can back now, which moves a little between
    // the session's start and this second reading on a busy machine.
    let again = s.config().pool_config(None).limit;
    assert!(
        again.abs_diff(limit) <= limit / 100,
        "the session's pool ({limit}) is not the configured auto size ({again})"
    );
    drop(s);

    // Room for one LocalIO lane (4 x 64 KiB), or two MemIO lanes (2 x 64 KiB each): each
    // transport's transfers take the room the other's idle lane keeps, and reuse its buffers.
    let config = Config::from_toml(
        "memory_pool_size = \"256 KiB\"\n\
         [memio]\nchunk_size = \"64 KiB\"\nslots_per_lane = 2\nthreads = 3\n\
         [localio]\nchunk_size = \"64 KiB\"\nslots_per_lane = 4\nlanes = 3",
        None,
    )
    .unwrap();
    let s = Session::new(config).unwrap();
    let pool = s.staging_pool();
    assert_eq!(pool.stats().limit, 256 << 10);
    let len = (1 << 20) + 99;
    let mut data = vec![0u8; len];
    pattern::fill(&mut data, 0, 8);
    let dev = s.alloc_device(0, len).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("src");
    std::fs::write(&path, &data).unwrap();
    let file = s.open_file(&path, OpenOptions::READ).unwrap();
    for round in 0..3 {
        let r = s.memio().upload_staged(&data, &dev, 0).unwrap();
        assert!(
            matches!(r, MemIoRoute::StagedPipeline { lanes: 2, .. }),
            "{r:?}"
        );
        let t = s.localio().read_to_device(&file, 0, &dev, 0, len).unwrap();
        assert_eq!(t.lanes, 1, "round {round}");
        let mut back = vec![0u8; len];
        s.download(&dev, 0, &mut back).unwrap();
        assert_eq!(pattern::first_deviation(&back, 0, 8), None);
    }
    let st = pool.stats();
    assert!(st.peak_pinned_bytes <= 256 << 10, "{st:?}");
    assert_eq!(st.failures, 0, "{st:?}");
    assert!(
        st.reclaimed_bytes >= 5 * (256 << 10),
        "idle lanes gave way: {st:?}"
    );
    assert_eq!(
        st.allocations, 4,
        "the first lanes' buffers, reused ever since: {st:?}"
    );
    assert!(st.reuses >= 5 * 4, "{st:?}");
}
