//! `gpuio stat` against endpoints that misbehave, each served by a thread of the test: an
//! endless body, a trickle, a very large exposition, label text with terminal escapes, a
//! server that never answers and a closed port. Each ends in bounded time with its own error
//! code (exit status: 3 invalid argument, 5 timeout, 7 network).

use crate::common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Runs `gpuio stat --addr addr` with `extra` arguments; returns its output and how long it
/// ran. Fails the test (killing it) past 60 s: the endpoints here once held it forever.
fn stat(addr: &str, extra: &[&str]) -> (Output, Duration) {
    let start = Instant::now();
    let mut child = Command::new(common::bin())
        .args(["stat", "--addr", addr])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("gpuio runs");
    // Drained while it runs, so a large summary cannot block it on a full pipe.
    let mut stdout = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut out = Vec::new();
        stdout.read_to_end(&mut out).ok();
        out
    });
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > Duration::from_secs(60) {
            child.kill().ok();
            child.wait().ok();
            panic!("gpuio stat {addr} {extra:?} hung");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let took = start.elapsed();
    let mut out = child.wait_with_output().unwrap();
    out.stdout = reader.join().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.status.code(), Some(101), "gpuio panicked: {err}");
    (out, took)
}

/// Serves one connection on a loopback port: reads the request's head, then hands the
/// stream to `respond`. Returns the address.
fn serve_once(respond: impl FnOnce(&mut TcpStream) + Send + 'static) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") && s.read(&mut byte).is_ok_and(|n| n == 1) {
            head.push(byte[0]);
        }
        respond(&mut s);
    });
    addr
}

/// A sized 200 response carrying `body`.
fn respond_with(body: String) -> impl FnOnce(&mut TcpStream) + Send + 'static {
    move |s| {
        let head = format!(
            "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        s.write_all(head.as_bytes()).ok();
        s.write_all(body.as_bytes()).ok();
    }
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A body that never ends is read up to the cap, then refused with an error naming it (it
/// once grew to gigabytes).
#[test]
fn an_endless_body_is_refused_at_the_cap() {
    let addr = serve_once(|s| {
        s.write_all(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n")
            .ok();
        let line = "gpuio_queue_depth 1\n".repeat(4096);
        while s.write_all(line.as_bytes()).is_ok() {}
    });
    let (o, took) = stat(&addr, &[]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(3), "{err}");
    assert!(
        err.contains("larger than 32 MiB") && err.contains("GPUIO_ERROR_INVALID_ARG"),
        "{err}"
    );
    assert!(took < Duration::from_secs(20), "{took:?}");
}

/// A byte now and then keeps every single read alive; the scrape's one deadline still ends
/// it, as a timeout.
#[test]
fn a_trickling_response_times_out_at_the_deadline() {
    let addr = serve_once(|s| {
        for b in b"HTTP/1.1 200 OK\r\n\r\ngpuio_queue_depth 1\n".repeat(100) {
            if s.write_all(&[b]).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    });
    let (o, took) = stat(&addr, &["--timeout", "2"]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(5), "{err}");
    assert!(
        err.contains("GPUIO_ERROR_TIMEOUT") && err.contains("no whole response within 2s"),
        "{err}"
    );
    assert!(
        took >= Duration::from_secs(2) && took < Duration::from_secs(10),
        "{took:?}"
    );
}

/// A listener that accepts nothing: the connection is made (the kernel's backlog), no answer
/// comes, and the deadline ends the wait as a timeout.
#[test]
fn a_server_that_never_answers_times_out() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let (o, took) = stat(&addr, &["--timeout", "1"]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(5), "{err}");
    assert!(err.contains("GPUIO_ERROR_TIMEOUT"), "{err}");
    assert!(took < Duration::from_secs(8), "{took:?}");
    drop(listener);
}

/// Nothing listens: a network error (connection refused), not an invalid argument.
#[test]
fn a_closed_port_is_a_network_error() {
    let addr = {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().to_string()
    };
    let (o, took) = stat(&addr, &[]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(7), "{err}");
    assert!(
        err.contains("GPUIO_ERROR_NETWORK") && err.contains("refused"),
        "{err}"
    );
    assert!(took < Duration::from_secs(8), "{took:?}");
}

/// About 17 MiB of valid exposition with 42,000 latency classes is summarised in seconds
/// (the summary was quadratic in the classes: 78 s of CPU).
#[test]
fn a_large_exposition_is_summarised_in_seconds() {
    let classes = 42_000;
    let mut body = String::from("gpuio_requests_submitted_total{engine=\"memio\"} 5\n");
    // Long class names, as a hostile or merely busy endpoint might send.
    let pad = "p".repeat(64);
    for c in 0..classes {
        for q in ["0.5", "0.99"] {
            body += &format!(
                "gpuio_request_latency_seconds{{engine=\"memio\",class=\"{pad}{c}\",\
                 quantile=\"{q}\"}} 0.000003\n"
            );
        }
        body += &format!(
            "gpuio_request_latency_seconds_count{{engine=\"memio\",class=\"{pad}{c}\"}} 1\n"
        );
    }
    assert!(body.len() > 17 << 20, "{} bytes", body.len());
    let addr = serve_once(respond_with(body));
    let (o, took) = stat(&addr, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(out.matches("latency p50").count(), classes);
    assert!(out.contains("memio     requests 5"), "{out:.300}");
    assert!(took < Duration::from_secs(15), "{took:?}");
}

/// Label text and the raw exposition are the endpoint's: their escape sequences reach the
/// terminal as text, never as commands.
#[test]
fn escape_sequences_from_the_endpoint_are_printed_escaped() {
    let body = "gpuio_requests_submitted_total{engine=\"memio\"} 1\n\
                gpuio_request_latency_seconds{engine=\"memio\",class=\"a\u{1b}[2J\u{1b}]0;pwned\u{7}\u{9b}1m\",quantile=\"0.5\"} 0.001\n\
                gpuio_request_latency_seconds_count{engine=\"memio\",class=\"a\u{1b}[2J\u{1b}]0;pwned\u{7}\u{9b}1m\"} 2\n\
                gpuio_\u{1b}[31mred 1\n";
    for raw in [false, true] {
        let addr = serve_once(respond_with(body.to_string()));
        let args: &[&str] = if raw { &["--raw"] } else { &[] };
        let (o, _) = stat(&addr, args);
        assert!(o.status.success(), "{}", stderr(&o));
        let out = String::from_utf8(o.stdout.clone()).unwrap();
        assert!(
            !out.contains(['\u{1b}', '\u{7}', '\u{9b}']),
            "raw={raw}: {out:?}"
        );
        assert!(
            out.contains("a\\x1b[2J\\x1b]0;pwned\\x07\\u{9b}1m"),
            "raw={raw}: {out}"
        );
        if raw {
            assert!(out.contains("gpuio_\\x1b[31mred 1\n"), "{out}");
        }
    }
}
