//! Resource URIs, as users, configuration files and C and Python callers give them.
//!
//! What must hold: a URI parses or is a typed error naming a position within the input; a
//! parsed URI shows as text that parses back to the same URI, unless it holds a character
//! shown escaped for people (a control or bidirectional-override character), which is the
//! one place the round trip is given up.

use crate::Target;
use gpuio_api::{Error, RemoteTarget, Uri};

pub const TARGET: Target = Target {
    name: "uri",
    parses: "resource URIs (memio, localio, file, remoteio, nvme, gpuio, plain paths)",
    sources: &["crates/gpuio-api/src/uri", "crates/gpuio-nvme/src/pci.rs"],
    run,
    seeds,
};

fn run(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let uri = match Uri::parse(text) {
        Ok(u) => u,
        Err(Error::Uri { position, .. }) => {
            assert!(
                position <= text.len(),
                "{text:?}: position {position} is past the end"
            );
            return;
        }
        Err(e) => panic!("{text:?}: not a URI error: {e}"),
    };
    if escaped_for_people(&uri) {
        return;
    }
    let shown = uri.to_string();
    match Uri::parse(&shown) {
        Ok(again) => assert_eq!(again, uri, "{text:?} shows as {shown:?}"),
        Err(e) => {
            panic!("{text:?} parses to {uri:?}, shown as {shown:?}, which does not parse: {e}")
        }
    }
}

/// Whether the URI holds text that `Display` escapes.
fn escaped_for_people(uri: &Uri) -> bool {
    let texts: Vec<String> = match uri {
        Uri::Cxl { pool, .. } => vec![pool.clone()],
        Uri::File { path, .. } => vec![path.to_string_lossy().into_owned()],
        Uri::Nvme { address, .. } => vec![address.clone()],
        Uri::Remote {
            target, resource, ..
        } => vec![
            match target {
                RemoteTarget::Address { host, .. } => host.clone(),
                RemoteTarget::Segment(s) => s.clone(),
            },
            resource.clone(),
        ],
        _ => Vec::new(),
    };
    texts.iter().flat_map(|t| t.chars()).any(|c| {
        c.is_control()
            || matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
    })
}

/// One URI of every form the grammar has, and some it refuses.
fn seeds() -> Vec<Vec<u8>> {
    [
        "gpu0",
        "memio://gpu/3",
        "memio://cpu/dram",
        "memio://cpu/dram?numa=1",
        "memio://cxl/pool0?device=1",
        "localio:///data/x.bin?direct=1&gds=0",
        "file:///tmp/a%20b",
        "/var/lib/weights.safetensors",
        "relative/path",
        "remoteio://10.0.0.2:7000/ckpt/shard0?transport=rdma&gdr=1",
        "remoteio://[fe80::1]:7000/r",
        "remoteio://segment-a/kv?transport=tcp",
        "nvme://0000:00:04.0/1",
        "nvme://00:04.0/2",
        "gpuio://memio/gpu/1",
        "gpuio://gpuio/localio/tmp/x",
        "memio://cpu/dram?numa=",
        "remoteio://h:99999/r",
        "localio:///x?direct=2",
    ]
    .iter()
    .map(|s| s.as_bytes().to_vec())
    .collect()
}
