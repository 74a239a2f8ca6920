//! What a metrics endpoint answers `gpuio stat`: an HTTP response and the Prometheus text in
//! its body, summarised for a terminal.
//!
//! What must hold: any response is read or refused without a panic; what the summary and the
//! raw view print holds no control character of the endpoint's (no escape sequence reaches the
//! terminal), whatever the labels say; rates over two scrapes are computed for any pair.

use crate::Target;
use gpuio_cli::exposition::{content_length, escape_lines, parse, response_body, summary};

pub const TARGET: Target = Target {
    name: "metrics",
    parses: "HTTP responses of a metrics endpoint and the Prometheus text gpuio stat summarises",
    sources: &["crates/gpuio-cli/src/exposition.rs"],
    run,
    seeds,
};

fn run(data: &[u8]) {
    // The scrape reads the length from the head as soon as the head is in.
    let head = data
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map_or(data, |i| &data[..i]);
    let _ = content_length(head);
    let Ok(body) = response_body(data) else {
        return;
    };
    // The body as two scrapes: the rates compare the second with the first.
    let half = (0..=body.len() / 2)
        .rev()
        .find(|&i| body.is_char_boundary(i))
        .unwrap_or(0);
    let (first, second) = body.split_at(half);
    let first = first.rsplit_once('\n').map_or(first, |(a, _)| a);
    let (a, b) = (parse(first), parse(second));
    for out in [
        summary(&b, None),
        summary(&b, Some((&a, 1.0))),
        escape_lines(&body),
    ] {
        assert!(
            !out.chars().any(|c| c.is_control() && c != '\n'),
            "printed unescaped: {out:?}"
        );
    }
}

fn seeds() -> Vec<Vec<u8>> {
    let body = "# TYPE gpuio_requests_submitted_total counter\n\
                gpuio_requests_submitted_total{engine=\"memio\"} 12\n\
                gpuio_requests_finished_total{engine=\"memio\",outcome=\"ok\"} 11\n\
                gpuio_bytes_total{engine=\"memio\"} 1073741824\n\
                gpuio_request_latency_seconds{engine=\"memio\",class=\"inference\",quantile=\"0.5\"} 0.00002\n\
                gpuio_request_latency_seconds{engine=\"memio\",class=\"inference\",quantile=\"0.99\"} 0.0001\n\
                gpuio_request_latency_seconds_count{engine=\"memio\",class=\"inference\"} 11\n\
                gpuio_cache_lookups_total{level=\"l1\",result=\"hit\"} 3\n\
                gpuio_pool_limit_bytes 1073741824\n\
                gpuio_page_cache_keep_limit_bytes 2147483648\n";
    [
        format!(
            "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        ),
        format!("HTTP/1.0 200 OK\r\n\r\n{body}{body}"),
        "HTTP/1.1 404 Not Found\r\n\r\n".into(),
        "HTTP/1.1 200 OK\r\ncontent-length: 99999999999999999999\r\n\r\nx".into(),
    ]
    .into_iter()
    .map(String::into_bytes)
    .collect()
}
