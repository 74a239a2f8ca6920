//! Unit tests of URIs: the grammar's examples, shorthands, errors and where they point,
//! bounded nesting, escaping, and (property tests) display round trips and arbitrary input.

use super::*;
use crate::error::UriProblem;
use proptest::prelude::*;

fn ok(s: &str) -> Uri {
    Uri::parse(s).unwrap_or_else(|e| panic!("{s}: {e}"))
}

fn problem(s: &str) -> (usize, UriProblem) {
    match Uri::parse(s) {
        Err(Error::Uri {
            position, problem, ..
        }) => (position, problem),
        other => panic!("{s}: expected a URI error, got {other:?}"),
    }
}

#[test]
fn the_grammar_examples_parse() {
    assert_eq!(ok("memio://cpu/dram?numa=0"), Uri::Dram { numa: Some(0) });
    assert_eq!(
        ok("memio://cxl/pool0?device=0"),
        Uri::Cxl {
            pool: "pool0".into(),
            device: 0
        }
    );
    assert_eq!(
        ok("localio:///dev/nvme0n1"),
        Uri::File {
            path: "/dev/nvme0n1".into(),
            direct: false,
            gds: None
        }
    );
    assert_eq!(
        ok("localio:///mnt/data/file.dat?direct=1&gds=1"),
        Uri::File {
            path: "/mnt/data/file.dat".into(),
            direct: true,
            gds: Some(true)
        }
    );
    assert_eq!(
        ok("remoteio://192.168.1.100:5555/dataset?transport=rdma&gdr=1"),
        Uri::Remote {
            target: RemoteTarget::Address {
                host: "192.168.1.100".into(),
                port: 5555
            },
            resource: "dataset".into(),
            transport: RemoteTransport::Rdma,
            gdr: true
        }
    );
    assert_eq!(
        ok("remoteio://kv-node:5555/kv?transport=nixl"),
        Uri::Remote {
            target: RemoteTarget::Address {
                host: "kv-node".into(),
                port: 5555
            },
            resource: "kv".into(),
            transport: RemoteTransport::Nixl,
            gdr: false
        }
    );
}

#[test]
fn shorthands_and_aliases() {
    assert_eq!(ok("gpu0"), Uri::Gpu(0));
    assert_eq!(ok("gpu12"), Uri::Gpu(12));
    assert_eq!(ok("memio://gpu/3"), Uri::Gpu(3));
    assert_eq!(
        ok("gpuio://memio/cpu/dram?numa=1"),
        Uri::Dram { numa: Some(1) }
    );
    assert_eq!(
        ok("gpuio://localio/mnt/x?direct=1"),
        ok("localio:///mnt/x?direct=1")
    );
    assert_eq!(ok("file:///tmp/a%20b"), ok("localio:///tmp/a b"));
    assert_eq!(
        ok("data/x.bin"),
        Uri::File {
            path: "data/x.bin".into(),
            direct: false,
            gds: None
        }
    );
    assert_eq!(
        ok("remoteio://kv-segment/layer3"),
        Uri::Remote {
            target: RemoteTarget::Segment("kv-segment".into()),
            resource: "layer3".into(),
            transport: RemoteTransport::Tcp,
            gdr: false
        }
    );
    assert!(matches!(
        ok("remoteio://[::1]:80/r"),
        Uri::Remote { target: RemoteTarget::Address { ref host, port: 80 }, .. } if host == "::1"
    ));
}

/// Found by fuzzing: empty and half-bracketed hosts were taken (and shown as URIs that do not
/// parse), and an error in `gpuio://<engine>` with no `/` pointed past the end.
#[test]
fn hosts_are_whole_and_positions_within_the_input() {
    assert_eq!(
        problem("remoteio://[]:7000/r"),
        (12, UriProblem::MissingHost)
    );
    for bad in [
        "remoteio://80::1]:7[fe80::1]:7000/r",
        "remoteio://a]b:1/r",
        "remoteio://s[g/r",
    ] {
        assert!(matches!(problem(bad).1, UriProblem::BadHost(_)), "{bad}");
    }
    for input in ["gpuio://gpuio", "gpuio://gpuio/lOcalio", "gpuio://memio"] {
        let (position, _) = problem(input);
        assert!(position <= input.len(), "{input}: {position}");
    }
    let v6 = Uri::parse("remoteio://fe80::1:7000/r").unwrap();
    assert_eq!(Uri::parse(&v6.to_string()).unwrap(), v6);
}

#[test]
fn malformed_uris_say_what_and_where() {
    assert_eq!(problem(""), (0, UriProblem::Empty));
    assert_eq!(
        problem("nvmf://x").1,
        UriProblem::UnknownScheme("nvmf".into())
    );
    assert!(matches!(problem("1a://x").1, UriProblem::BadScheme(_)));
    let (pos, p) = problem("memio://cpu/dram?numa=x");
    assert_eq!(pos, 17);
    assert!(matches!(p, UriProblem::BadParam { ref name, .. } if name == "numa"));
    let (pos, p) = problem("memio://cpu/dram?numa=0&speed=9");
    assert_eq!(pos, 24);
    assert!(matches!(p, UriProblem::UnknownParam { ref name, .. } if name == "speed"));
    assert!(matches!(
        problem("memio://cpu/hbm").1,
        UriProblem::UnknownResource { .. }
    ));
    assert!(matches!(
        problem("memio://").1,
        UriProblem::MissingResource { .. }
    ));
    assert!(matches!(
        problem("memio://tape/x").1,
        UriProblem::UnknownResource { .. }
    ));
    assert!(matches!(
        problem("memio://cxl/?device=0").1,
        UriProblem::MissingResource { .. }
    ));
    assert!(matches!(
        problem("memio://gpu/x").1,
        UriProblem::UnknownResource { .. }
    ));
    assert_eq!(
        problem("memio://cpu/dram?numa=1&numa=2").1,
        UriProblem::DuplicateParam("numa".into())
    );
    assert_eq!(
        problem("memio://cpu/dram?numa").1,
        UriProblem::MissingValue("numa".into())
    );
    assert!(matches!(
        problem("localio://relative/path").1,
        UriProblem::NotAbsolute(_)
    ));
    assert!(matches!(
        problem("localio:///x?direct=maybe").1,
        UriProblem::BadParam { .. }
    ));
    assert!(matches!(
        problem("file:///x?direct=1").1,
        UriProblem::UnknownParam { .. }
    ));
    assert_eq!(problem("file:///a%2").1, UriProblem::BadPercentEncoding);
    // A file's path is bytes: percent-encoded ones that are not UTF-8 name that file.
    {
        use std::os::unix::ffi::OsStrExt;
        match ok("localio:///d/%FF%FEx%20y%3F?direct=1") {
            Uri::File { path, direct, .. } => {
                assert_eq!(path.as_os_str().as_bytes(), b"/d/\xff\xfex y?");
                assert!(direct);
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(
        problem("remoteio://h:1/%FF").1,
        UriProblem::BadPercentEncoding,
        "a remote resource's name is text"
    );
    assert_eq!(
        problem("remoteio://h:0/r").1,
        UriProblem::BadPort("0".into())
    );
    assert_eq!(
        problem("remoteio://h:99999/r").1,
        UriProblem::BadPort("99999".into())
    );
    assert_eq!(problem("remoteio:///r").1, UriProblem::MissingHost);
    assert!(matches!(
        problem("remoteio://h:1/").1,
        UriProblem::MissingResource { .. }
    ));
    assert!(matches!(
        problem("remoteio://h:1/r?transport=udp").1,
        UriProblem::BadParam { .. }
    ));
    assert!(matches!(problem("gpu").1, UriProblem::BadGpuShorthand(_)));
    assert!(matches!(problem("gpu0x").1, UriProblem::BadGpuShorthand(_)));
    for bad in ["gpuio://memio/cpu/dram?numa=x", "gpuio://localio/x?numa=1"] {
        let (pos, _) = problem(bad);
        assert_eq!(&bad[pos..pos + 4], "numa", "{bad}");
    }
    let msg = Uri::parse("memio://cpu/dram?numa=x")
        .unwrap_err()
        .to_string();
    assert!(msg.contains("numa") && msg.contains("byte 17"), "{msg}");
}

#[test]
fn nesting_is_bounded_not_a_stack_overflow() {
    // `levels` gpuio:// wrappers around `inner`.
    let nest =
        |levels: usize, inner: &str| format!("gpuio://{}{inner}", "gpuio/".repeat(levels - 1));
    // Up to the bound, each level unwraps the next.
    assert_eq!(ok(&nest(MAX_URI_NESTING, "localio/x")), ok("localio:///x"));
    assert_eq!(
        ok(&nest(MAX_URI_NESTING, "memio/cpu/dram")),
        Uri::Dram { numa: None }
    );
    // Beyond it, a typed error; 100k levels used to overflow the stack (SIGABRT).
    for levels in [MAX_URI_NESTING + 1, 100_000] {
        let input = nest(levels, "memio/cpu/dram");
        let (pos, p) = problem(&input);
        assert_eq!(
            p,
            UriProblem::TooDeep {
                max: MAX_URI_NESTING
            }
        );
        assert_eq!(pos, 8 + 6 * (MAX_URI_NESTING - 1), "{input}");
        let e = Uri::parse(&input).unwrap_err();
        assert_eq!(e.code(), gpuio_core::ErrorCode::InvalidArg);
    }
}

#[test]
fn display_escapes_control_characters() {
    for (uri, raw) in [
        (ok("rel/\x1b[2Jx\ny"), "\x1b"),
        (ok("memio://cxl/p\x1b]0;t\x07?device=0"), "\x07"),
        (ok("remoteio://seg\x1bment/r"), "\x1b"),
        (ok("remoteio://h\0st:9/r"), "\0"),
        (ok("file:///a%1Bb%0A"), "\x1b"),
    ] {
        let shown = uri.to_string();
        assert!(!shown.contains(raw) && !shown.contains('\n'), "{shown:?}");
    }
    assert_eq!(ok("rel/\x1bx").to_string(), "rel/\\x1bx");
}

fn any_uri() -> impl Strategy<Value = Uri> {
    prop_oneof![
        (0u32..64).prop_map(Uri::Gpu),
        proptest::option::of(0u32..8).prop_map(|numa| Uri::Dram { numa }),
        ("[a-z][a-z0-9_]{0,8}", 0u32..4).prop_map(|(pool, device)| Uri::Cxl { pool, device }),
        ("[0-9a-f]{4}:[0-9a-f]{2}:[01][0-9a-f]\\.[0-7]", 1u32..1024)
            .prop_map(|(address, nsid)| Uri::Nvme { address, nsid }),
        (
            "(/[a-zA-Z0-9 ._%?#-]{1,12}){1,3}",
            any::<bool>(),
            proptest::option::of(any::<bool>())
        )
            .prop_map(|(p, direct, gds)| Uri::File {
                path: p.into(),
                direct,
                gds
            }),
        (
            "[a-z][a-z0-9.-]{0,10}",
            1u16..,
            "[a-z0-9/_]{1,10}",
            0..3u8,
            any::<bool>()
        )
            .prop_filter("resource must not start with /", |(_, _, r, _, _)| !r
                .starts_with('/'))
            .prop_map(|(host, port, resource, transport, gdr)| Uri::Remote {
                target: RemoteTarget::Address { host, port },
                resource,
                transport: match transport {
                    0 => RemoteTransport::Tcp,
                    1 => RemoteTransport::Rdma,
                    _ => RemoteTransport::Nixl,
                },
                gdr,
            }),
    ]
}

#[test]
fn nvme_namespaces_parse_and_bad_ones_are_pointed_at() {
    let want = |address: &str, nsid| Uri::Nvme {
        address: address.into(),
        nsid,
    };
    assert_eq!(ok("nvme://0000:00:04.0/1"), want("0000:00:04.0", 1));
    assert_eq!(ok("nvme://3B:00.1/2"), want("0000:3b:00.1", 2));
    assert_eq!(ok("gpuio://nvme/00:04.0/1"), want("0000:00:04.0", 1));
    assert_eq!(
        ok("nvme://ffff:ff:1f.7/4294967294"),
        want("ffff:ff:1f.7", 0xFFFF_FFFE)
    );
    assert_eq!(
        ok("nvme://0000:00:04.0/1").to_string(),
        "nvme://0000:00:04.0/1"
    );
    for (bad, at) in [
        ("nvme://localhost/1", 7),
        ("nvme:///1", 7),
        ("nvme://0000:00:04.0", 19),
        ("nvme://0000:00:04.0/0", 19),
        ("nvme://0000:00:04.0/x", 19),
        ("nvme://0000:00:04.0/1/2", 19),
        ("nvme://0000:00:04.0/+1", 19),
        ("nvme://0000:00:04.0/-1", 19),
        ("nvme://0000:00:04.0/4294967295", 19),
        ("nvme://0000:00:04.0/4294967296", 19),
        // PCI has 32 devices of 8 functions a bus.
        ("nvme://0000:00:04.8/1", 7),
        ("nvme://0000:00:20.0/1", 7),
        ("nvme://00:ff.7/1", 7),
    ] {
        let (position, problem) = problem(bad);
        assert!(
            matches!(problem, UriProblem::UnknownResource { .. }),
            "{bad}: {problem:?}"
        );
        assert_eq!(position, at, "{bad}");
    }
    let (_, p) = problem("nvme://0000:00:04.0/1?direct=1");
    assert!(matches!(p, UriProblem::UnknownParam { .. }), "{p:?}");
}

proptest! {
    #[test]
    fn display_round_trips(u in any_uri()) {
        let s = u.to_string();
        prop_assert_eq!(Uri::parse(&s).unwrap(), u);
    }

    #[test]
    fn arbitrary_input_never_panics(s in ".{0,64}") {
        let _ = Uri::parse(&s);
    }
}
