//! Configuration files (TOML) and the `GPUIO_*` environment overrides.
//!
//! What must hold: a document or an override either gives a configuration or a typed
//! configuration error; a configuration accepted from either one is one a file could say (it
//! renders as TOML that parses back to the same configuration); and every engine setting
//! derived from it can be computed (no overflow, no panic).

use crate::Target;
use arbitrary::{Arbitrary, Unstructured};
use gpuio_api::{Config, Error};
use std::sync::OnceLock;

pub const TARGET: Target = Target {
    name: "config",
    parses: "configuration files (TOML merged over the defaults, then validated)",
    sources: &["crates/gpuio-api/src/config"],
    run,
    seeds,
};

pub const ENV_TARGET: Target = Target {
    name: "env",
    parses: "GPUIO_* environment overrides",
    sources: &["crates/gpuio-api/src/config"],
    run: run_env,
    seeds: env_seeds,
};

/// The first byte picks the form: even, TOML text as written; odd, a document of settings
/// drawn from the real ones (each key path of the defaults) with values of any TOML type.
fn run(data: &[u8]) {
    let text = match data.split_first() {
        Some((mode, rest)) if mode & 1 == 0 => match std::str::from_utf8(rest) {
            Ok(t) => t.to_owned(),
            Err(_) => return,
        },
        Some((_, rest)) => match document(&mut Unstructured::new(rest)) {
            Ok(t) => t,
            Err(_) => return,
        },
        None => return,
    };
    match Config::from_toml(&text, None) {
        Ok(c) => holds(&c, &text),
        Err(Error::Config { .. }) => {}
        Err(e) => panic!("{text:?}: not a configuration error: {e}"),
    }
}

fn run_env(data: &[u8]) {
    let mut u = Unstructured::new(data);
    let Ok(vars) = Vec::<(u8, String)>::arbitrary(&mut u) else {
        return;
    };
    let vars: Vec<(&str, String)> = vars
        .into_iter()
        .map(|(k, v)| (ENV_VARS[usize::from(k) % ENV_VARS.len()], v))
        .collect();
    let mut c = Config::default();
    let get = |k: &str| {
        vars.iter()
            .rev()
            .find(|(n, _)| *n == k)
            .map(|(_, v)| v.clone())
    };
    match c.apply_env(get) {
        Ok(()) => holds(&c, &format!("{vars:?}")),
        Err(Error::ConfigEnv { .. } | Error::Config { .. }) => {}
        Err(e) => panic!("{vars:?}: not a configuration error: {e}"),
    }
}

/// What an accepted configuration must give.
fn holds(c: &Config, from: &str) {
    let toml = c.to_toml();
    let again = Config::from_toml(&toml, None)
        .unwrap_or_else(|e| panic!("{from:?} gives a configuration that renders as {toml:?}: {e}"));
    assert_eq!(&again, c, "{from:?} renders as {toml:?}");
    let _ = (c.memio_config(), c.localio_config(), c.scheduler_config());
    let _ = (c.pool_config(None), c.lane_staging_bytes());
}

/// Every variable `apply_env` reads.
const ENV_VARS: &[&str] = &[
    "GPUIO_BACKEND",
    "GPUIO_CACHE_PREFETCH",
    "GPUIO_CACHE_PREFETCH_DEPTH",
    "GPUIO_CACHE_WRITE_POLICY",
    "GPUIO_HOST_DEVICES",
    "GPUIO_LOCALIO_ENGINE",
    "GPUIO_LOCALIO_GDS",
    "GPUIO_LOG",
    "GPUIO_MAX_GPUS",
    "GPUIO_MEMORY_POOL_SIZE",
    "GPUIO_PIPELINE_MIN",
    "GPUIO_PIPELINE_THREADS",
    "GPUIO_SCHED_POLICY",
    "GPUIO_STAGING_CHUNK",
    "GPUIO_WORKERS",
];

/// The key paths of the default configuration (`memio.chunk_size`, …).
fn key_paths() -> &'static [Vec<String>] {
    static PATHS: OnceLock<Vec<Vec<String>>> = OnceLock::new();
    PATHS.get_or_init(|| {
        fn walk(t: &toml::Table, at: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
            for (k, v) in t {
                at.push(k.clone());
                match v {
                    toml::Value::Table(sub) => walk(sub, at, out),
                    _ => out.push(at.clone()),
                }
                at.pop();
            }
        }
        let defaults: toml::Table =
            toml::from_str(&Config::default().to_toml()).expect("the defaults render as TOML");
        let mut out = Vec::new();
        walk(&defaults, &mut Vec::new(), &mut out);
        out
    })
}

/// A TOML value of any type, drawn from the input.
#[derive(Arbitrary, Debug)]
enum Value {
    Int(i64),
    Float(f64),
    Bool(bool),
    Text(String),
    Size(u16, u8),
    List(Vec<i64>),
}

impl Value {
    fn toml(self) -> toml::Value {
        match self {
            Self::Int(i) => i.into(),
            Self::Float(f) => f.into(),
            Self::Bool(b) => b.into(),
            Self::Text(s) => s.into(),
            // Sizes as people write them: "4MiB", "3 GB".
            Self::Size(n, unit) => {
                let units = [
                    "", "B", "KiB", "MiB", "GiB", "TiB", "K", "M", "G", "kB", "MB", "auto",
                ];
                format!("{n}{}", units[usize::from(unit) % units.len()]).into()
            }
            Self::List(v) => toml::Value::Array(v.into_iter().map(toml::Value::from).collect()),
        }
    }
}

/// A document setting some of the real keys (and now and then one that is not).
fn document(u: &mut Unstructured<'_>) -> arbitrary::Result<String> {
    let paths = key_paths();
    let mut doc = toml::Table::new();
    for _ in 0..u.int_in_range(1..=8)? {
        let mut path = paths[u.choose_index(paths.len())?].clone();
        if u.ratio(1, 16)? {
            *path.last_mut().expect("a key") = String::arbitrary(u)?;
        }
        let value = Value::arbitrary(u)?.toml();
        set(&mut doc, &path, value);
    }
    Ok(toml::to_string(&doc).unwrap_or_default())
}

/// Sets `path` in `doc` to `value`, making the tables on the way (a value where a table is
/// needed is replaced).
fn set(doc: &mut toml::Table, path: &[String], value: toml::Value) {
    match path {
        [] => {}
        [leaf] => {
            doc.insert(leaf.clone(), value);
        }
        [table, rest @ ..] => {
            let entry = doc
                .entry(table.clone())
                .or_insert_with(|| toml::Table::new().into());
            if !entry.is_table() {
                *entry = toml::Table::new().into();
            }
            if let toml::Value::Table(t) = entry {
                set(t, rest, value);
            }
        }
    }
}

fn seeds() -> Vec<Vec<u8>> {
    let mut out = vec![[&[0u8][..], Config::default().to_toml().as_bytes()].concat()];
    for text in [
        "workers = 8\n[memio]\nchunk_size = \"8MiB\"\n",
        "memory_pool_size = \"auto\"\n[localio]\npage_cache = \"off\"\n",
        "[remote]\nconnections = 0\n",
        "[scheduler]\npolicy = \"deadline\"\n",
        "[cache]\nwrite_policy = \"back\"\n",
    ] {
        out.push([&[0u8][..], text.as_bytes()].concat());
    }
    for i in 0..16u8 {
        out.push([1, i, i.wrapping_mul(37), 3, 200, i, 7, 9].to_vec());
    }
    out
}

fn env_seeds() -> Vec<Vec<u8>> {
    (0..ENV_VARS.len() as u8)
        .map(|i| [&[i, 4][..], b"4MiB"].concat())
        .chain([
            b"\x00\x04auto".to_vec(),
            b"\x09\x03 1G".to_vec(),
            b"\x0e\x010".to_vec(),
        ])
        .collect()
}
