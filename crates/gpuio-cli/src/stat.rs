//! Metrics: `--metrics-addr` serves gpuio's metrics for Prometheus while a command runs
//! (loopback by default); `gpuio stat` reads such an endpoint and prints what matters:
//! throughput, latency quantiles, queue depth, in-flight bytes, errors, deadline misses,
//! cache and registration hit rates, and the pinned staging pool (its `memory_pool_size`
//! limit, bytes held, in use and at the high-water mark, waits and failures).

use gpuio_api::Error;
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// Where `--metrics-addr` listens when given no address, and where `stat` looks.
pub const DEFAULT_ADDR: &str = "127.0.0.1:9464";

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
}

/// One sample: metric name, labels, value.
type Samples = Vec<(String, BTreeMap<String, String>, f64)>;

fn scrape(addr: SocketAddr) -> Result<String, Error> {
    let fail = |e: std::io::Error| Error::Invalid(format!("reading metrics from {addr}: {e}"));
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).map_err(fail)?;
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .map_err(fail)?;
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .map_err(fail)?;
    let mut text = String::new();
    s.read_to_string(&mut text).map_err(fail)?;
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    if !head.starts_with("HTTP/1.1 200") && !head.starts_with("HTTP/1.0 200") {
        let status = head.lines().next().unwrap_or("no response");
        return Err(Error::Invalid(format!("{addr} answered {status:?}")));
    }
    Ok(body.to_string())
}

/// Parses the Prometheus text format (the subset the exporter writes).
fn parse(text: &str) -> Samples {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let value: f64 = value.parse().ok()?;
            let (name, labels) = match series.split_once('{') {
                Some((n, rest)) => (n, rest.trim_end_matches('}')),
                None => (series, ""),
            };
            let labels = labels
                .split(',')
                .filter_map(|kv| {
                    let (k, v) = kv.split_once('=')?;
                    Some((k.to_string(), v.trim_matches('"').to_string()))
                })
                .collect();
            Some((name.to_string(), labels, value))
        })
        .collect()
}

fn sum(s: &Samples, name: &str, filter: &[(&str, &str)]) -> f64 {
    s.iter()
        .filter(|(n, l, _)| {
            n == name
                && filter
                    .iter()
                    .all(|(k, v)| l.get(*k).is_some_and(|x| x == v))
        })
        .map(|(_, _, v)| v)
        .sum::<f64>()
        // An empty sum of f64 is -0.0, which prints as "-0".
        + 0.0
}

fn summary(s: &Samples, prev: Option<(&Samples, f64)>) -> String {
    use gpuio_core::metrics as m;
    let mut out = String::new();
    let rate = |name: &str, f: &[(&str, &str)]| {
        prev.map(|(p, secs)| (sum(s, name, f) - sum(p, name, f)) / secs)
    };
    for engine in ["memio", "localio", "remoteio"] {
        let e = [("engine", engine)];
        let submitted = sum(s, m::REQUESTS_SUBMITTED, &e);
        if submitted == 0.0 {
            continue;
        }
        let ok = sum(
            s,
            m::REQUESTS_FINISHED,
            &[("engine", engine), ("outcome", "ok")],
        );
        let err = sum(
            s,
            m::REQUESTS_FINISHED,
            &[("engine", engine), ("outcome", "error")],
        );
        let cancelled = sum(
            s,
            m::REQUESTS_FINISHED,
            &[("engine", engine), ("outcome", "cancelled")],
        );
        let bytes = sum(s, m::BYTES, &e);
        out += &format!(
            "{engine:<9} requests {submitted:.0} (ok {ok:.0}, errors {err:.0}, cancelled {cancelled:.0}), {:.3} GB moved, in flight {:.1} MiB\n",
            bytes / 1e9,
            sum(s, m::IN_FLIGHT_BYTES, &e) / (1 << 20) as f64
        );
        if let Some(r) = rate(m::BYTES, &e) {
            let q = rate(m::REQUESTS_SUBMITTED, &e).unwrap_or(0.0);
            out += &format!("          now: {:.3} GB/s, {q:.0} requests/s\n", r / 1e9);
        }
        let mut classes: Vec<&String> = s
            .iter()
            .filter(|(n, l, _)| n == m::LATENCY && l.get("engine").is_some_and(|x| x == engine))
            .filter_map(|(_, l, _)| l.get("class"))
            .collect();
        classes.dedup();
        for class in classes {
            let q = |quantile: &str| {
                sum(
                    s,
                    m::LATENCY,
                    &[("engine", engine), ("class", class), ("quantile", quantile)],
                ) * 1e6
            };
            let n = sum(
                s,
                &format!("{}_count", m::LATENCY),
                &[("engine", engine), ("class", class)],
            );
            if n > 0.0 {
                out += &format!(
                    "          {class:<20} latency p50 {:>9.1} us  p99 {:>9.1} us  ({n:.0})\n",
                    q("0.5"),
                    q("0.99")
                );
            }
        }
    }
    out += &format!("queue depth {:.0}\n", sum(s, m::QUEUE_DEPTH, &[]));
    let deadlines = sum(s, m::DEADLINE_REQUESTS, &[]);
    if deadlines > 0.0 {
        let missed = sum(s, m::DEADLINE_MISSES, &[]);
        out += &format!(
            "deadlines: {deadlines:.0} requests, {missed:.0} missed ({:.2}%)\n",
            100.0 * missed / deadlines
        );
    }
    out += &format!(
        "retries {:.0}, failovers {:.0}\n",
        sum(s, m::RETRIES, &[]),
        sum(s, m::FAILOVERS, &[])
    );
    for level in ["l1", "l2", "l3"] {
        let hit = sum(s, m::CACHE_LOOKUPS, &[("level", level), ("result", "hit")]);
        let miss = sum(s, m::CACHE_LOOKUPS, &[("level", level), ("result", "miss")]);
        if hit + miss > 0.0 {
            out += &format!(
                "cache {level}: {:.1}% hits of {:.0} lookups, {:.0} evictions\n",
                100.0 * hit / (hit + miss),
                hit + miss,
                sum(s, m::CACHE_EVICTIONS, &[("level", level)])
            );
        }
    }
    let (rh, rm) = (
        sum(s, m::REG_LOOKUPS, &[("result", "hit")]),
        sum(s, m::REG_LOOKUPS, &[("result", "miss")]),
    );
    if rh + rm > 0.0 {
        out += &format!(
            "registrations: {:.1}% hits of {:.0} lookups\n",
            100.0 * rh / (rh + rm),
            rh + rm
        );
    }
    out += &pool_summary(s);
    out += &page_cache_summary(s);
    out
}

/// The page cache registrations kept for hot files: what they pin against their limit
/// (`page_cache_keep`), and how reads fared. Empty where none were reported.
fn page_cache_summary(s: &Samples) -> String {
    use gpuio_core::metrics as m;
    let limit = sum(s, m::PAGE_CACHE_LIMIT_BYTES, &[]);
    if limit <= 0.0 {
        return String::new();
    }
    let mib = |v: f64| v / (1 << 20) as f64;
    format!(
        "page cache: {:.0} hot file(s) kept registered, {:.1} MiB pinned of {:.1} MiB; \
         {:.0} of {:.0} reads served by a kept registration, {:.0} let go\n",
        sum(s, m::PAGE_CACHE_KEPT_FILES, &[]),
        mib(sum(s, m::PAGE_CACHE_KEPT_BYTES, &[])),
        mib(limit),
        sum(s, m::PAGE_CACHE_READS, &[("result", "hit")]),
        sum(s, m::PAGE_CACHE_READS, &[]),
        sum(s, m::PAGE_CACHE_RELEASED, &[]),
    )
}

/// The staging pool's lines: its limit (`memory_pool_size`), what it holds, what the lanes
/// have of it, its high-water mark, and how requests fared. Empty where no pool reports.
fn pool_summary(s: &Samples) -> String {
    use gpuio_core::metrics as m;
    let limit = sum(s, m::POOL_LIMIT_BYTES, &[]);
    if limit <= 0.0 {
        return String::new();
    }
    let mib = |v: f64| v / (1 << 20) as f64;
    let event = |e: &str| sum(s, m::POOL_EVENTS, &[("event", e)]);
    format!(
        "staging pool: limit {:.1} MiB; {:.1} MiB pinned, {:.1} MiB in use, high water {:.1} MiB\n\
         \x20             {:.0} allocations, {:.0} reuses, {:.0} releases, {:.1} MiB reclaimed \
         from idle lanes, {:.0} waits, {:.0} failures\n",
        mib(limit),
        mib(sum(s, m::POOL_PINNED_BYTES, &[])),
        mib(sum(s, m::POOL_IN_USE_BYTES, &[])),
        mib(sum(s, m::POOL_PEAK_BYTES, &[])),
        event("allocation"),
        event("reuse"),
        event("release"),
        mib(sum(s, m::POOL_RECLAIMED_BYTES, &[])),
        event("wait"),
        event("failure"),
    )
}

pub fn run(args: &StatArgs) -> Result<(), Error> {
    let mut prev: Option<Samples> = None;
    loop {
        let text = scrape(args.addr)?;
        if args.raw {
            print!("{text}");
        } else {
            let samples = parse(&text);
            let secs = args.watch.map_or(0.0, |w| w.as_secs_f64());
            print!(
                "{}",
                summary(&samples, prev.as_ref().map(|p| (p, secs.max(1e-3))))
            );
            prev = Some(samples);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_exposition_format_parses() {
        let text =
            "# TYPE x counter\nx{engine=\"memio\",class=\"a\"} 3\nx{engine=\"localio\"} 4\ny 1.5\n";
        let s = parse(text);
        assert_eq!(s.len(), 3);
        assert_eq!(sum(&s, "x", &[]), 7.0);
        assert_eq!(sum(&s, "x", &[("engine", "memio")]), 3.0);
        assert_eq!(sum(&s, "y", &[]), 1.5);
    }

    #[test]
    fn kept_page_cache_registrations_are_summarised_where_reported() {
        assert_eq!(page_cache_summary(&parse("x 1\n")), "");
        let text = "gpuio_page_cache_keep_limit_bytes 2147483648\n\
                    gpuio_page_cache_kept_bytes 1073741824\n\
                    gpuio_page_cache_kept_files 1\n\
                    gpuio_page_cache_reads_total{result=\"hit\"} 5\n\
                    gpuio_page_cache_reads_total{result=\"miss\"} 2\n\
                    gpuio_page_cache_released_total 1\n";
        assert_eq!(
            page_cache_summary(&parse(text)),
            "page cache: 1 hot file(s) kept registered, 1024.0 MiB pinned of 2048.0 MiB; \
             5 of 7 reads served by a kept registration, 1 let go\n"
        );
    }

    #[test]
    fn the_staging_pool_is_summarised_where_one_reports() {
        assert_eq!(pool_summary(&parse("x 1\n")), "");
        let text = "gpuio_pool_limit_bytes 1073741824\n\
                    gpuio_pool_pinned_bytes 100663296\n\
                    gpuio_pool_in_use_bytes 50331648\n\
                    gpuio_pool_peak_pinned_bytes 134217728\n\
                    gpuio_pool_events_total{event=\"allocation\"} 24\n\
                    gpuio_pool_events_total{event=\"reuse\"} 7\n\
                    gpuio_pool_events_total{event=\"wait\"} 2\n\
                    gpuio_pool_reclaimed_bytes_total 8388608\n";
        let out = pool_summary(&parse(text));
        assert_eq!(
            out,
            "staging pool: limit 1024.0 MiB; 96.0 MiB pinned, 48.0 MiB in use, high water \
             128.0 MiB\n              24 allocations, 7 reuses, 0 releases, 8.0 MiB reclaimed \
             from idle lanes, 2 waits, 0 failures\n"
        );
    }

    /// Cached reads through a session, recorded by a Prometheus recorder of the test's own
    /// (what `--metrics-addr` installs), rendered as the endpoint serves it: the summary shows
    /// each level's hit rate and evictions, equal to the cache's own counters.
    #[test]
    fn cached_reads_show_their_hit_rates_per_level() {
        use gpuio_api::{Access, CacheLevel, Config, Session, Uri};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("data");
        let mut data = vec![0u8; 64 * 4096];
        gpuio_hal::pattern::fill(&mut data, 0, 5);
        std::fs::write(&path, &data).unwrap();
        // L1: 4 blocks of 4 KiB; L2: 16; no prefetching, so every lookup is the test's.
        let cfg = Config::from_toml(
            "[cache]\nblock_size = \"4 KiB\"\nl1_size = \"16 KiB\"\nl2_size = \"64 KiB\"\n\
             prefetch = false\n",
            None,
        )
        .unwrap();
        let session = Session::new(cfg).unwrap();
        let uri = Uri::parse(path.to_str().unwrap()).unwrap();
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        // The cache binds its counters to the recorder in effect when it is built.
        let file =
            metrics::with_local_recorder(&recorder, || session.open_cached(&uri, Access::Read))
                .unwrap();
        let mut buf = vec![0u8; 8 * 4096];
        // Blocks 0-7 miss both levels; 4-7 end in L1, 0-3 were pushed down to L2.
        file.read(0, &mut buf).unwrap();
        assert_eq!(gpuio_hal::pattern::first_deviation(&buf, 0, 5), None);
        // 4-7 hit L1; 0-3 miss L1, hit L2 and move up, pushing 4-7 down.
        file.read(4 * 4096, &mut buf[..4 * 4096]).unwrap();
        file.read(0, &mut buf[..4 * 4096]).unwrap();
        assert_eq!(gpuio_hal::pattern::first_deviation(&buf, 0, 5), None);
        let stats = file.stats();
        let l1 = stats.level(CacheLevel::L1).unwrap();
        let l2 = stats.level(CacheLevel::L2).unwrap();
        assert_eq!((l1.hits, l1.misses, l1.evictions), (4, 12, 8));
        assert_eq!((l2.hits, l2.misses, l2.evictions), (4, 8, 0));

        let text = handle.render();
        let out = summary(&parse(&text), None);
        assert!(
            out.contains("cache l1: 25.0% hits of 16 lookups, 8 evictions\n"),
            "{out}\n{text}"
        );
        assert!(
            out.contains("cache l2: 33.3% hits of 12 lookups, 0 evictions\n"),
            "{out}\n{text}"
        );
        assert!(!out.contains("cache l3"), "{out}");
    }
}
