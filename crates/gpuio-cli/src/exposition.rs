//! What a metrics endpoint answers `gpuio stat`, parsed and summarised: the HTTP response
//! (status and body), the Prometheus text format (the subset the exporter writes), and the
//! summary printed for people: throughput, latency quantiles, queue depth, in-flight bytes,
//! errors, deadline misses, cache and registration hit rates, and the pinned staging pool.
//!
//! The endpoint is not trusted: the summary's work is linear in the samples, and whatever
//! text of the endpoint's is printed is escaped (the `metrics` fuzz target holds it to that).

use std::collections::HashMap;

/// The body of an HTTP response whose status is 200, or the status line it had instead.
pub fn response_body(response: &[u8]) -> Result<String, String> {
    let text = String::from_utf8_lossy(response);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    if !head.starts_with("HTTP/1.1 200") && !head.starts_with("HTTP/1.0 200") {
        return Err(head.lines().next().unwrap_or("no response").to_owned());
    }
    Ok(body.to_owned())
}

/// The `Content-Length` of a response head, if it gives one.
pub fn content_length(head: &[u8]) -> Option<usize> {
    String::from_utf8_lossy(head).lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.trim()
            .eq_ignore_ascii_case("content-length")
            .then(|| v.trim().parse().ok())?
    })
}

/// Samples by metric name: each one's label text (between the braces, as written) and
/// value. Borrowed from the exposition text, so a sample costs a few words.
pub type Samples<'a> = HashMap<&'a str, Vec<(&'a str, f64)>>;

/// Parses the Prometheus text format (the subset the exporter writes), keeping gpuio's
/// metrics only (the summary reads nothing else).
pub fn parse(text: &str) -> Samples<'_> {
    let mut out: Samples<'_> = HashMap::new();
    for l in text.lines() {
        if l.starts_with('#') {
            continue;
        }
        let Some((series, value)) = l.rsplit_once(' ') else {
            continue;
        };
        let Ok(value) = value.parse::<f64>() else {
            continue;
        };
        let (name, labels) = match series.split_once('{') {
            Some((n, rest)) => (n, rest.strip_suffix('}').unwrap_or(rest)),
            None => (series, ""),
        };
        if name.starts_with("gpuio_") {
            out.entry(name).or_default().push((labels, value));
        }
    }
    out
}

/// The value of label `key` in `labels` (the text between a sample's braces), as written
/// there (escapes kept).
fn label<'a>(labels: &'a str, key: &str) -> Option<&'a str> {
    let mut rest = labels;
    loop {
        let (k, after) = rest.split_once('=')?;
        let after = after.strip_prefix('"')?;
        // The value ends at the first quote no backslash escapes.
        let mut escaped = false;
        let end = after.char_indices().find_map(|(i, c)| {
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, '"') => return Some(i),
                _ => {}
            }
            None
        })?;
        if k.trim() == key {
            return Some(&after[..end]);
        }
        rest = after[end + 1..].trim_start_matches([',', ' ']);
        if rest.is_empty() {
            return None;
        }
    }
}

fn sum(s: &Samples<'_>, name: &str, filter: &[(&str, &str)]) -> f64 {
    s.get(name)
        .map_or(&[][..], Vec::as_slice)
        .iter()
        .filter(|(l, _)| filter.iter().all(|(k, v)| label(l, k) == Some(*v)))
        .map(|(_, v)| v)
        .sum::<f64>()
        // An empty sum of f64 is -0.0, which prints as "-0".
        + 0.0
}

/// `engine`'s latency classes in the order they first appear, each with its p50 and p99 (in
/// seconds) and its count: one pass over the latency samples, however many classes there are.
fn latencies<'a>(s: &Samples<'a>, engine: &str) -> Vec<(&'a str, [f64; 3])> {
    use gpuio_core::metrics as m;
    let mut order: Vec<(&'a str, [f64; 3])> = Vec::new();
    let mut index: HashMap<&'a str, usize> = HashMap::new();
    let quantiles = s.get(m::LATENCY).map_or(&[][..], Vec::as_slice);
    for (l, v) in quantiles {
        if label(l, "engine") != Some(engine) {
            continue;
        }
        let Some(class) = label(l, "class") else {
            continue;
        };
        let i = *index.entry(class).or_insert_with(|| {
            order.push((class, [0.0; 3]));
            order.len() - 1
        });
        match label(l, "quantile") {
            Some("0.5") => order[i].1[0] += v,
            Some("0.99") => order[i].1[1] += v,
            _ => {}
        }
    }
    let counts = s
        .get(format!("{}_count", m::LATENCY).as_str())
        .map_or(&[][..], Vec::as_slice);
    for (l, v) in counts {
        if label(l, "engine") == Some(engine)
            && let Some(&i) = label(l, "class").and_then(|c| index.get(c))
        {
            order[i].1[2] += v;
        }
    }
    order
}

/// The summary of one scrape, with rates over the interval where the previous one (and the
/// seconds since) is given.
pub fn summary(s: &Samples<'_>, prev: Option<(&Samples<'_>, f64)>) -> String {
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
        for (class, [p50, p99, n]) in latencies(s, engine) {
            if n > 0.0 {
                // The class is the endpoint's text: shown escaped, never as terminal input.
                let class = gpuio_api::escape(class);
                out += &format!(
                    "          {class:<20} latency p50 {:>9.1} us  p99 {:>9.1} us  ({n:.0})\n",
                    p50 * 1e6,
                    p99 * 1e6
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
fn page_cache_summary(s: &Samples<'_>) -> String {
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
fn pool_summary(s: &Samples<'_>) -> String {
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

/// `text` with every line [`gpuio_api::escape`]d: its line breaks kept, any other control
/// character or escape sequence shown as text.
pub fn escape_lines(text: &str) -> String {
    let lines: Vec<_> = text.split('\n').map(gpuio_api::escape).collect();
    lines.join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_exposition_format_parses() {
        let text = "# TYPE gpuio_x counter\ngpuio_x{engine=\"memio\",class=\"a\"} 3\n\
                    gpuio_x{engine=\"localio\"} 4\ngpuio_y 1.5\nother 9\n\
                    gpuio_z{class=\"a \\\"b\\\", c=d\",engine=\"memio\"} 2\n";
        let s = parse(text);
        // Only gpuio's metrics are kept: the summary reads nothing else.
        assert_eq!(s.values().map(Vec::len).sum::<usize>(), 4);
        assert_eq!(sum(&s, "gpuio_x", &[]), 7.0);
        assert_eq!(sum(&s, "gpuio_x", &[("engine", "memio")]), 3.0);
        assert_eq!(sum(&s, "gpuio_y", &[]), 1.5);
        assert_eq!(sum(&s, "other", &[]), 0.0);
        // A quoted value may hold commas, equals signs and escaped quotes.
        assert_eq!(sum(&s, "gpuio_z", &[("engine", "memio")]), 2.0);
        let (labels, _) = s["gpuio_z"][0];
        assert_eq!(label(labels, "class"), Some("a \\\"b\\\", c=d"));
    }

    /// Label text is the endpoint's: an escape sequence in it is printed as text.
    #[test]
    fn label_values_are_printed_escaped() {
        let text = "gpuio_requests_submitted_total{engine=\"memio\"} 1\n\
                    gpuio_request_latency_seconds{engine=\"memio\",class=\"x\u{1b}[2J\u{1b}]0;t\u{7}\",quantile=\"0.5\"} 0.001\n\
                    gpuio_request_latency_seconds_count{engine=\"memio\",class=\"x\u{1b}[2J\u{1b}]0;t\u{7}\"} 3\n";
        let out = summary(&parse(text), None);
        assert!(!out.contains('\u{1b}') && !out.contains('\u{7}'), "{out:?}");
        assert!(
            out.contains("x\\x1b[2J\\x1b]0;t\\x07") && out.contains("p50    1000.0 us"),
            "{out}"
        );
        assert_eq!(
            escape_lines("a\u{1b}[31m\nb\u{9b}\n"),
            "a\\x1b[31m\nb\\u{9b}\n"
        );
    }

    /// The summary of many latency classes is one pass over them: 50,000 classes take well
    /// under a few seconds (the summary was quadratic in them: 78 s of CPU for a 17 MiB
    /// exposition).
    #[test]
    fn many_latency_classes_are_summarised_in_linear_time() {
        let classes = 50_000;
        let mut text = String::from("gpuio_requests_submitted_total{engine=\"memio\"} 1\n");
        for c in 0..classes {
            for q in ["0.5", "0.99"] {
                text += &format!(
                    "gpuio_request_latency_seconds{{engine=\"memio\",class=\"c{c}\",quantile=\"{q}\"}} 0.000002\n"
                );
            }
            text += &format!(
                "gpuio_request_latency_seconds_count{{engine=\"memio\",class=\"c{c}\"}} {c}\n"
            );
        }
        let start = std::time::Instant::now();
        let out = summary(&parse(&text), None);
        let took = start.elapsed();
        // Class c0 has count 0 and is left out; the others each have a line.
        assert_eq!(out.matches("latency p50").count(), classes - 1);
        assert!(
            out.contains("c49999               latency p50       2.0 us"),
            "{out:.200}"
        );
        assert!(took < std::time::Duration::from_secs(5), "{took:?}");
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
