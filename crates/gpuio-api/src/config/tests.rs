//! Unit tests of the configuration: the embedded defaults, files and environment overrides,
//! the bounds, and which configuration and secret files are read.

use super::*;
use std::collections::HashMap;

#[test]
fn the_embedded_defaults_parse() {
    let c = Config::from_toml(DEFAULT_TOML, None).unwrap();
    assert_eq!(c, Config::default());
    assert_eq!(c.memio.chunk_size, ByteSize::mib(4));
    assert_eq!(c.retry, RetryPolicy::default());
    let round = Config::from_toml(&c.to_toml(), None).unwrap();
    assert_eq!(round, c);
}

/// Found by fuzzing: sizes rendered in `ByteSize`'s rounded form (`953.7 MiB` for
/// 1000000000 bytes) read back as other sizes.
#[test]
fn sizes_render_exactly() {
    let c = Config::from_toml(
        "memory_pool_size = \"1G\"\n[memio]\nchunk_size = 1000001\n\
         [localio]\npage_cache_threshold = \"3 MiB\"\n[cache]\nl2_size = \"1 GiB\"\n",
        None,
    )
    .unwrap();
    let text = c.to_toml();
    assert!(
        text.contains("chunk_size = \"1000001 B\"") && text.contains("\"3 MiB\""),
        "{text}"
    );
    assert_eq!(Config::from_toml(&text, None).unwrap(), c);
}

#[test]
fn files_override_only_what_they_name() {
    let c = Config::from_toml("workers = 9\n[memio]\nchunk_size = \"2MiB\"\n", None).unwrap();
    assert_eq!(c.workers, 9);
    assert_eq!(c.memio.chunk_size, ByteSize::mib(2));
    assert_eq!(c.memio.slots_per_lane, 3);
    assert_eq!(c.localio, Config::default().localio);
}

#[test]
fn bad_files_name_the_problem() {
    let e = Config::from_toml("wrokers = 2", None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("wrokers"), "{e}");
    let e = Config::from_toml("workers = \"many\"", None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("workers"), "{e}");
    let e = Config::from_toml("api_version = 7", None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("api_version 7"), "{e}");
    let e = Config::from_toml("[memio]\nslots_per_lane = 1", None).unwrap_err();
    assert_eq!(e.code(), gpuio_core::ErrorCode::InvalidArg);
    for bad in [
        "workers = 100000",
        "[memio]\nthreads = 5000",
        "[localio]\nchunk_size = \"8 GiB\"",
    ] {
        assert!(Config::from_toml(bad, None).is_err(), "{bad}");
    }
    let e = Config::from_file(Path::new("/nonexistent/gpuio.toml")).unwrap_err();
    assert!(e.to_string().contains("/nonexistent/gpuio.toml"));
}

#[test]
fn environment_overrides_and_rejects_garbage() {
    let env: HashMap<&str, &str> = [
        ("GPUIO_BACKEND", "host"),
        ("GPUIO_STAGING_CHUNK", "8MiB"),
        ("GPUIO_WORKERS", "2"),
        ("GPUIO_RESIDENT_LINGER_MS", "20"),
    ]
    .into();
    let mut c = Config::default();
    assert_eq!(c.memio_config().resident_linger, None);
    c.apply_env(|k| env.get(k).map(|v| v.to_string())).unwrap();
    assert_eq!(
        c.memio_config().resident_linger,
        Some(std::time::Duration::from_millis(20))
    );
    assert_eq!(c.backend, BackendPreference::Host);
    assert_eq!(c.memio.chunk_size, ByteSize::mib(8));
    assert_eq!(c.workers, 2);
    let err = c
        .apply_env(|k| (k == "GPUIO_MAX_GPUS").then(|| "lots".to_string()))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("GPUIO_MAX_GPUS") && err.contains("lots"),
        "{err}"
    );
}

#[test]
fn settings_that_would_hang_or_overflow_are_refused_naming_the_key() {
    let cases = [
        (
            "[agent]\nhandshake_timeout_ms = 0",
            "agent.handshake_timeout_ms",
        ),
        (
            "[agent]\nhandshake_timeout_ms = 9000000000",
            "agent.handshake_timeout_ms",
        ),
        ("[agent]\nmax_connections = 0", "agent.max_connections"),
        (
            "[memio]\nresident_linger_ms = 60001",
            "memio.resident_linger_ms",
        ),
        ("[agent]\nmax_handshakes = 0", "agent.max_handshakes"),
        (
            "[agent]\nmax_handshakes_per_address = 0",
            "agent.max_handshakes_per_address",
        ),
        (
            "[agent]\nmax_sessions_per_key = 0",
            "agent.max_sessions_per_key",
        ),
        ("[agent]\nio_timeout_ms = 0", "agent.io_timeout_ms"),
        ("[agent]\nidle_timeout_ms = 0", "agent.idle_timeout_ms"),
        ("[agent]\nbuffer_memory = \"1 MiB\"", "agent.buffer_memory"),
        ("[agent]\nthreads = 0", "agent.threads"),
        ("[agent]\nthreads = 65", "agent.threads"),
        ("[agent]\nlease_ttl_s = 0", "agent.lease_ttl_s"),
        (
            "[agent]\nlease_ttl_s = 9223372036854775807",
            "agent.lease_ttl_s",
        ),
        (
            "[[agent.exports]]\nname = \"m\"\naccess = \"read-only\"\nmemory = \"0 B\"",
            "memory = 0",
        ),
        ("[remote]\nconnections = 0", "remote.connections"),
        ("[remote]\nconnections = 100000", "remote.connections"),
        ("[remote]\ntimeout_ms = 0", "remote.timeout_ms"),
        ("[remote]\nstripe_size = \"0 B\"", "remote.stripe_size"),
        ("[remote]\nstripe_size = \"1 GiB\"", "remote.stripe_size"),
        ("[retry]\nmax_retries = 4000000000", "retry.max_retries"),
        (
            "[retry]\nmax_backoff_us = 9223372036854775807",
            "retry.max_backoff_us",
        ),
        (
            "[retry]\ninitial_backoff_us = 200000",
            "retry.initial_backoff_us",
        ),
        (
            "[retry]\nbackoff_multiplier = nan",
            "retry.backoff_multiplier",
        ),
        (
            "[retry]\nbackoff_multiplier = inf",
            "retry.backoff_multiplier",
        ),
        (
            "[retry]\nbackoff_multiplier = -2.0",
            "retry.backoff_multiplier",
        ),
    ];
    for (text, key) in cases {
        let e = Config::from_toml(text, None).expect_err(text);
        assert_eq!(e.code(), gpuio_core::ErrorCode::InvalidArg, "{text}");
        assert!(e.to_string().contains(key), "{text}: {e}");
    }
    // The edges of each range are taken.
    let fine = "[agent]\nhandshake_timeout_ms = 100\nmax_connections = 1\nthreads = 64\n\
                lease_ttl_s = 2\n[remote]\nconnections = 1\ntimeout_ms = 3600000\n\
                stripe_size = \"16 MiB\"\n[retry]\nmax_retries = 0\nbackoff_multiplier = 1.0";
    Config::from_toml(fine, None).unwrap();
}

/// Runs `f` on its own thread, failing if it does not return in 20 s (a FIFO read blocks).
fn within_20s<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || tx.send(f()));
    rx.recv_timeout(std::time::Duration::from_secs(20))
        .expect("blocked: a special file was opened or read as if it were regular")
}

fn mkfifo(path: &Path) {
    let ok = std::process::Command::new("mkfifo")
        .arg(path)
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "mkfifo {}", path.display());
}

#[test]
fn configuration_files_must_be_small_regular_files() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo.toml");
    mkfifo(&fifo);
    let big = dir.path().join("big.toml");
    // Valid TOML (comments) just over the cap.
    let line = format!("# {}\n", "x".repeat(1021));
    std::fs::write(&big, line.repeat((MAX_CONFIG_BYTES / 1024) as usize + 1)).unwrap();
    let exact = dir.path().join("exact.toml");
    let mut text = "workers = 3\n".to_string();
    text += &"#".repeat(MAX_CONFIG_BYTES as usize - text.len());
    std::fs::write(&exact, text).unwrap();
    assert_eq!(Config::from_file(&exact).unwrap().workers, 3);
    let cases = [
        (fifo, "a FIFO"),
        (PathBuf::from("/dev/zero"), "a character device"),
        (dir.path().to_path_buf(), "a directory"),
        (big, "bytes"),
    ];
    for (path, kind) in cases {
        let e = within_20s(move || Config::from_file(&path).map(|_| ()));
        let e = e.unwrap_err();
        assert_eq!(e.code(), gpuio_core::ErrorCode::InvalidArg);
        assert!(e.to_string().contains(kind), "{e}");
    }
}

#[test]
fn secret_files_must_be_small_private_regular_files() {
    use std::os::unix::fs::PermissionsExt;
    const SECRET: &str = "4d1f0c9a7e3b52d86a0f1e9c3b7d5a2e8c6f4b1a9d3e7c5f2b8a6d4e1c9f7b3a";
    let dir = tempfile::tempdir().unwrap();
    let key = |path: &Path| -> Result<Vec<u8>> {
        let text = format!(
            "[[agent.keys]]\nid = \"k\"\nrole = \"read-only\"\nsecret_file = {:?}\n\
             [remote]\nkey_id = \"k\"\nsecret_file = {:?}",
            path.display().to_string(),
            path.display().to_string()
        );
        let c = Config::from_toml(&text, None)?;
        let from_remote = c.remote_credentials()?.map(|k| k.secret);
        let from_agent = c.agent_config()?.keys[0].secret.clone();
        assert_eq!(from_remote.as_ref(), Some(&from_agent));
        Ok(from_agent)
    };
    let file = dir.path().join("key");
    std::fs::write(&file, format!("{SECRET}\n")).unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    assert_eq!(key(&file).unwrap(), SECRET.as_bytes());
    for mode in [0o644, 0o640, 0o604, 0o620, 0o602, 0o660] {
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(mode)).unwrap();
        let e = key(&file).unwrap_err().to_string();
        assert!(
            e.contains("chmod 600") && e.contains("key \"k\""),
            "{mode:o}: {e}"
        );
    }
    let big = dir.path().join("big");
    std::fs::write(&big, vec![b'a'; MAX_SECRET_BYTES as usize + 1]).unwrap();
    std::fs::set_permissions(&big, std::fs::Permissions::from_mode(0o600)).unwrap();
    let fifo = dir.path().join("fifo");
    mkfifo(&fifo);
    std::fs::set_permissions(&fifo, std::fs::Permissions::from_mode(0o600)).unwrap();
    for (path, kind) in [
        (big, "at most"),
        (fifo, "a FIFO"),
        (PathBuf::from("/dev/zero"), "a character device"),
    ] {
        let e = within_20s(move || key(&path).map(|_| ())).unwrap_err();
        assert_eq!(e.code(), gpuio_core::ErrorCode::InvalidArg);
        assert!(e.to_string().contains(kind), "{e}");
    }
}

#[test]
fn memory_pool_size_is_auto_a_size_or_refused_out_of_range() {
    // The default: sized at start, at least 1 GiB, and the pool's classes take both chunks.
    let c = Config::default();
    assert_eq!(c.memory_pool_size, PoolSize::Auto);
    assert!(c.to_toml().contains("memory_pool_size = \"auto\""));
    let pool = c.pool_config(None);
    assert!(pool.limit >= gpuio_staging::MIN_AUTO_LIMIT);
    assert_eq!(pool.max_class, 64 << 20);
    // One lane: MemIO's 3 x 4 MiB outweighs LocalIO's 2 x 4 MiB.
    assert_eq!(c.lane_staging_bytes(), 12 << 20);

    // Sizes as text or bytes, "auto" in any case; the environment overrides.
    for (text, want) in [
        (
            "memory_pool_size = \"2 GiB\"",
            PoolSize::Bytes(ByteSize::gib(2)),
        ),
        (
            "memory_pool_size = 33554432",
            PoolSize::Bytes(ByteSize::mib(32)),
        ),
        ("memory_pool_size = \"AUTO\"", PoolSize::Auto),
        (
            "memory_pool_size = \"16 MiB\"",
            PoolSize::Bytes(ByteSize::mib(16)),
        ),
    ] {
        let c = Config::from_toml(text, None).expect(text);
        assert_eq!(c.memory_pool_size, want, "{text}");
        assert_eq!(Config::from_toml(&c.to_toml(), None).unwrap(), c);
    }
    let c = Config::from_toml("memory_pool_size = \"64 MiB\"", None).unwrap();
    assert_eq!(c.pool_config(None).limit, 64 << 20);
    let mut c = Config::default();
    c.apply_env(|k| (k == "GPUIO_MEMORY_POOL_SIZE").then(|| "48MiB".to_string()))
        .unwrap();
    assert_eq!(c.memory_pool_size, PoolSize::Bytes(ByteSize::mib(48)));
    let err = c
        .apply_env(|k| (k == "GPUIO_MEMORY_POOL_SIZE").then(|| "lots".to_string()))
        .unwrap_err();
    assert!(err.to_string().contains("GPUIO_MEMORY_POOL_SIZE"), "{err}");
    let e = Config::from_toml("memory_pool_size = \"lots\"", None).unwrap_err();
    assert!(e.to_string().contains("memory_pool_size"), "{e}");

    // Below one lane, or above what the machine can back pinned: typed, naming the key and
    // the bound.
    for (text, bound) in [
        ("memory_pool_size = 0", "12.0 MiB"),
        ("memory_pool_size = 12582911", "one staging lane"),
        (
            "memory_pool_size = \"32 MiB\"\n[localio]\nchunk_size = \"3 MiB\"\nslots_per_lane = 9",
            "36.0 MiB",
        ),
        ("memory_pool_size = \"1 PiB\"", "can back as pinned memory"),
        ("GPUIO: env", "can back as pinned memory"),
    ] {
        let e = if text == "GPUIO: env" {
            let mut c = Config::default();
            c.apply_env(|k| (k == "GPUIO_MEMORY_POOL_SIZE").then(|| "1 PiB".to_string()))
                .unwrap_err()
        } else {
            Config::from_toml(text, None).unwrap_err()
        };
        assert_eq!(e.code(), gpuio_core::ErrorCode::InvalidArg, "{text}");
        assert!(matches!(e, Error::Config { .. }), "{text}: {e:?}");
        let msg = e.to_string();
        assert!(
            msg.contains("memory_pool_size") && msg.contains(bound),
            "{text}: {msg}"
        );
    }
    // A larger chunk raises both the lane and the largest class.
    let c = Config::from_toml(
        "memory_pool_size = \"1 GiB\"\n[memio]\nchunk_size = \"100 MiB\"",
        None,
    )
    .unwrap();
    assert_eq!(c.pool_config(None).max_class, 128 << 20);
    assert_eq!(c.lane_staging_bytes(), 3 * (128 << 20));
}

#[test]
fn timeouts_too_short_to_ever_succeed_are_refused_saying_why() {
    for (text, key, floor) in [
        ("[agent]\nio_timeout_ms = 1", "agent.io_timeout_ms", "100"),
        ("[agent]\nio_timeout_ms = 99", "agent.io_timeout_ms", "100"),
        (
            "[agent]\nhandshake_timeout_ms = 1",
            "agent.handshake_timeout_ms",
            "100",
        ),
        (
            "[agent]\nidle_timeout_ms = 999",
            "agent.idle_timeout_ms",
            "1000",
        ),
        ("[remote]\ntimeout_ms = 1", "remote.timeout_ms", "100"),
    ] {
        let e = Config::from_toml(text, None).expect_err(text);
        assert_eq!(e.code(), gpuio_core::ErrorCode::InvalidArg, "{text}");
        let msg = e.to_string();
        assert!(
            msg.contains(key)
                && msg.contains(&format!("must be {floor} to"))
                && msg.contains("below it"),
            "{text}: {msg}"
        );
    }
    let floors = "[agent]\nio_timeout_ms = 100\nhandshake_timeout_ms = 100\n\
                  idle_timeout_ms = 1000\n[remote]\ntimeout_ms = 100";
    Config::from_toml(floors, None).unwrap();
}

#[test]
fn page_cache_threads_and_keep_are_range_checked() {
    for (text, key, range) in [
        (
            "[localio]\npage_cache_threads = 0",
            "localio.page_cache_threads",
            "1 to 8",
        ),
        (
            "[localio]\npage_cache_threads = 9",
            "localio.page_cache_threads",
            "1 to 8",
        ),
        (
            "[localio]\npage_cache_threads = 9223372036854775807",
            "localio.page_cache_threads",
            "1 to 8",
        ),
        (
            "[localio]\npage_cache_keep = \"1 PiB\"",
            "localio.page_cache_keep",
            "must be 0 to",
        ),
    ] {
        let e = Config::from_toml(text, None).expect_err(text);
        assert_eq!(e.code(), gpuio_core::ErrorCode::InvalidArg, "{text}");
        let msg = e.to_string();
        assert!(msg.contains(key) && msg.contains(range), "{text}: {msg}");
    }
    for fine in [
        "[localio]\npage_cache_threads = 1\npage_cache_keep = 0",
        "[localio]\npage_cache_threads = 8\npage_cache_keep = \"64 MiB\"",
        "[localio]\npage_cache_keep = \"auto\"",
    ] {
        Config::from_toml(fine, None).expect(fine);
    }
}

#[test]
fn a_lane_larger_than_the_auto_pool_is_refused_at_load() {
    // 64 slots of 1 GiB: a lane of 64 GiB, above "auto" (a quarter of what the machine can
    // back) on any machine with less than 256 GiB available.
    let text = "[localio]\nchunk_size = \"1 GiB\"\nslots_per_lane = 64";
    if PoolSize::Auto.bytes() >= 64 << 30 {
        eprintln!("skipped: the auto pool holds a 64 GiB lane here");
        return;
    }
    let msg = Config::from_toml(text, None).unwrap_err().to_string();
    assert!(
        msg.contains("memory_pool_size = \"auto\"")
            && msg.contains("64.0 GiB")
            && msg.contains("localio.slots_per_lane x localio.chunk_size = 64 x 1.0 GiB"),
        "{msg}"
    );
    // The same lane in an explicit pool that is too small.
    let small = format!("memory_pool_size = \"2 GiB\"\n{text}");
    let msg = Config::from_toml(&small, None).unwrap_err().to_string();
    assert!(msg.contains("one staging lane"), "{msg}");
}
