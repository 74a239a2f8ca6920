//! Metrics: `--metrics-addr` serves gpuio's metrics for Prometheus while a command runs
//! (loopback by default); `gpuio stat` reads such an endpoint and prints what matters:
//! throughput, latency quantiles, queue depth, in-flight bytes, errors, deadline misses,
//! cache and registration hit rates, and the pinned staging pool (its `memory_pool_size`
//! limit, bytes held, in use and at the high-water mark, waits and failures).
//!
//! The endpoint is not trusted: a scrape has one deadline for connecting, asking and the
//! whole response, and the response is read up to [`MAX_RESPONSE`] bytes; what is read is
//! parsed and summarised by `gpuio_cli::exposition`.

use gpuio_api::Error;
use gpuio_cli::exposition::{content_length, escape_lines, parse, response_body, summary};
use gpuio_core::{CoreError, ErrorCode};
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// Where `--metrics-addr` listens when given no address, and where `stat` looks.
pub const DEFAULT_ADDR: &str = "127.0.0.1:9464";

/// The most bytes a scrape reads (status line, headers and body). gpuio's endpoint serves
/// kilobytes; an endpoint sending more than this is not one, and reading on would only grow
/// memory.
pub const MAX_RESPONSE: usize = 32 << 20;

/// Installs the Prometheus exporter on `addr` (the listener runs on its own thread).
pub fn serve(addr: SocketAddr) -> Result<(), Error> {
    metrics_exporter_prometheus::PrometheusBuilder::new()
        .with_http_listener(addr)
        .set_quantiles(&[0.5, 0.99])
        .and_then(|b| b.install())
        .map_err(|e| Error::Invalid(format!("metrics endpoint on {addr}: {e}")))?;
    gpuio_core::metrics::describe();
    tracing::info!(%addr, "serving metrics");
    Ok(())
}

#[derive(Debug, clap::Args)]
pub struct StatArgs {
    /// The metrics endpoint of a running gpuio (its --metrics-addr).
    #[arg(long, default_value = DEFAULT_ADDR, value_name = "HOST:PORT")]
    addr: SocketAddr,
    /// Print again every SECS seconds, with rates over the interval.
    #[arg(long, value_name = "SECS", value_parser = crate::parse_seconds,
          allow_negative_numbers = true)]
    watch: Option<Duration>,
    /// Print the raw exposition text instead of the summary.
    #[arg(long)]
    raw: bool,
    /// Give up on a scrape (connecting, asking and reading the whole response) after SECS
    /// seconds.
    #[arg(long, value_name = "SECS", default_value = "10", value_parser = crate::parse_seconds,
          allow_negative_numbers = true)]
    timeout: Duration,
}

/// An error with its own code (a timeout, a refused connection), naming the endpoint.
fn failed(code: ErrorCode, addr: SocketAddr, what: impl std::fmt::Display) -> Error {
    Error::Core(CoreError::Failed {
        code,
        message: format!("reading metrics from {addr}: {what}"),
    })
}

/// Reads the exposition text of the endpoint at `addr`, all of it within `timeout`.
fn scrape(addr: SocketAddr, timeout: Duration) -> Result<String, Error> {
    let deadline = Instant::now() + timeout;
    let late = || {
        failed(
            ErrorCode::Timeout,
            addr,
            format_args!("no whole response within {timeout:?}"),
        )
    };
    // A socket timeout reads as WouldBlock (EAGAIN), which would otherwise map to BUSY.
    let io = |e: std::io::Error| match e.kind() {
        ErrorKind::TimedOut | ErrorKind::WouldBlock => late(),
        _ => failed(ErrorCode::from_io(&e), addr, e),
    };
    // What is left of the deadline; every blocking call waits at most that long.
    let left = || {
        deadline
            .checked_duration_since(Instant::now())
            .filter(|d| !d.is_zero())
            .ok_or_else(late)
    };
    let mut s = TcpStream::connect_timeout(&addr, left()?).map_err(io)?;
    s.set_write_timeout(Some(left()?)).map_err(io)?;
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .map_err(io)?;
    let mut response = Vec::new();
    let mut chunk = vec![0u8; 64 << 10];
    // Where the body starts and how long it is, once the head has been read.
    let mut body: Option<(usize, Option<usize>)> = None;
    loop {
        s.set_read_timeout(Some(left()?)).map_err(io)?;
        let n = match s.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(io(e)),
        };
        if response.len() + n > MAX_RESPONSE {
            return Err(Error::Invalid(format!(
                "reading metrics from {addr}: the response is larger than {} MiB, the most \
                 stat reads",
                MAX_RESPONSE >> 20
            )));
        }
        // Only the bytes new since the last search (and 3 before) can complete the head.
        let from = response.len().saturating_sub(3);
        response.extend_from_slice(&chunk[..n]);
        if body.is_none()
            && let Some(i) = response[from..].windows(4).position(|w| w == b"\r\n\r\n")
        {
            let start = from + i + 4;
            body = Some((start, content_length(&response[..start])));
        }
        // A server that keeps the connection open after a sized body is done here.
        if let Some((start, Some(len))) = body
            && response.len() - start >= len
        {
            response.truncate(start + len);
            break;
        }
    }
    response_body(&response).map_err(|status| Error::Invalid(format!("{addr} answered {status:?}")))
}

pub fn run(args: &StatArgs) -> Result<(), Error> {
    // The samples borrow their text: the last scrape's is kept for the rates.
    let mut prev: Option<String> = None;
    loop {
        let text = scrape(args.addr, args.timeout)?;
        if args.raw {
            print!("{}", escape_lines(&text));
        } else {
            let samples = parse(&text);
            let before = prev.as_deref().map(parse);
            let secs = args.watch.map_or(0.0, |w| w.as_secs_f64());
            print!(
                "{}",
                summary(&samples, before.as_ref().map(|p| (p, secs.max(1e-3))))
            );
            prev = Some(text);
        }
        match args.watch {
            Some(every) if !every.is_zero() => {
                std::thread::sleep(every);
                println!();
            }
            _ => return Ok(()),
        }
    }
}
