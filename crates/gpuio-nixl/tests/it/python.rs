//! Interoperability with NIXL's own Python API: a NIXL agent in a Python process
//! (`nixl_peer.py`) and gpuio's agent read and write each other's registered memory, with
//! only the metadata exchanged between them (here over the child's pipes), every byte checked.

use gpuio_hal::{HostAllocOptions, HostBuffer};
use gpuio_nixl::{NixlAgent, NixlMem, NixlRemote};
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};

/// The field `key` of a JSON line as written by `nixl_peer.py` (flat, no escapes).
fn field<'a>(line: &'a str, key: &str) -> &'a str {
    let at = line.find(&format!("\"{key}\": ")).expect(key) + key.len() + 4;
    let rest = &line[at..];
    let end = rest.find([',', '}']).unwrap();
    rest[..end].trim_matches('"')
}

/// The peer's next line that is not NIXL's log (which its Python API writes to stdout).
fn said(from: &mut impl BufRead) -> String {
    let mut line = String::new();
    loop {
        line.clear();
        if from.read_line(&mut line).unwrap() == 0 || !line.contains(" NIXL ") {
            return line;
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

#[test]
fn a_nixl_python_agent_and_gpuio_read_and_write_each_other() {
    if crate::nixl().is_none() {
        return;
    }
    let Some(path) = std::env::var_os("GPUIO_NIXL_PYTHONPATH") else {
        gpuio_testkit::Requirement::Nixl.missing(
            "GPUIO_NIXL_PYTHONPATH (where NIXL's Python package is, `cargo xtask nixl`) is not set",
        );
        return;
    };
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/it/nixl_peer.py");
    let mut child = Command::new("python3")
        .arg(script)
        .env("PYTHONPATH", path)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3");
    let mut to = child.stdin.take().unwrap();
    let mut from = BufReader::new(child.stdout.take().unwrap());
    let line = said(&mut from);
    assert!(line.starts_with('{'), "the peer said: {line:?}");

    // gpuio reads the Python agent's buffer.
    let agent = NixlAgent::new("gpuio-interop").unwrap();
    let len: usize = field(&line, "len").parse().unwrap();
    let peer = agent.connect(&unhex(field(&line, "metadata"))).unwrap();
    assert_eq!(peer.name(), "nixl-python");
    let remote = NixlRemote {
        addr: field(&line, "addr").parse().unwrap(),
        len: len as u64,
        mem: NixlMem::Host,
    };
    let mut got = HostBuffer::alloc(len, &HostAllocOptions::default()).unwrap();
    let local = agent.register(&got, 0..len).unwrap();
    agent
        .read_into(&local, got.as_mut_slice(), &peer, &remote, 0)
        .unwrap();
    let bad = (0..len)
        .filter(|&i| got.as_slice()[i] != ((i * 7 + 3) % 251) as u8)
        .count();
    assert_eq!(bad, 0, "wrong bytes read from the Python agent");

    // The Python agent reads gpuio's region, then writes into it.
    const N: usize = 1 << 20;
    let mut exposed = HostBuffer::alloc(N, &HostAllocOptions::default()).unwrap();
    for (i, b) in exposed.as_mut_slice().iter_mut().enumerate() {
        *b = ((i * 13 + 5) % 253) as u8;
    }
    let region = agent.register(&exposed, 0..N).unwrap();
    let me = region.remote();
    writeln!(
        to,
        "{{\"metadata\": \"{}\", \"addr\": {}, \"len\": {}}}",
        hex(&agent.metadata().unwrap()),
        me.addr,
        me.len
    )
    .unwrap();
    assert_eq!(said(&mut from).trim(), "ok", "the Python agent failed");
    for (i, &b) in exposed.as_slice().iter().enumerate() {
        let want = if (8192..8192 + 4096).contains(&i) {
            ((i - 8192) * 3 + 1) % 256
        } else {
            (i * 13 + 5) % 253
        };
        assert_eq!(b, want as u8, "byte {i} after the Python agent's write");
    }
    drop(to);
    assert!(child.wait().unwrap().success());
}
