//! `gpuio agent`: serves this node's exports (the `[agent]` section of the configuration) to
//! other nodes over RemoteIO until SIGINT or SIGTERM, then shuts down gracefully: the requests
//! in flight finish, and what was served is printed.
//!
//! With `[agent] segment` set, the agent registers in the registry (`[remote] registry`) as
//! serving that segment, under a lease it renews; the registration is revoked at shutdown
//! (and expires on its own if the agent dies).
//!
//! `gpuio agent keygen [--out FILE]` makes a new key secret (32 random bytes as 64 hex
//! characters) for `secret_env` / `secret_file`.

use gpuio_api::{Config, Error, escape, escape_path};
use gpuio_transport_remoteio::Agent;
use std::path::{Path, PathBuf};

/// Arguments of `gpuio agent` (the agent is configured by `--config FILE`, `[agent]`).
#[derive(Debug, clap::Args)]
pub struct AgentArgs {
    #[command(subcommand)]
    command: Option<AgentCommand>,
}

#[derive(Debug, clap::Subcommand)]
enum AgentCommand {
    /// Prints a new key secret (32 random bytes as 64 hex characters), or writes it to a new
    /// file readable only by its owner: the secret_file (or what secret_env names) of an
    /// agent's key and of the clients' remote section.
    Keygen {
        /// Write the secret to this file (created with mode 0600; an existing file is never
        /// overwritten) instead of printing it.
        #[arg(long, value_name = "FILE")]
        out: Option<PathBuf>,
    },
}

impl AgentArgs {
    /// Whether this is `gpuio agent keygen`, which needs no configuration.
    pub fn is_keygen(&self) -> bool {
        matches!(self.command, Some(AgentCommand::Keygen { .. }))
    }
}

/// `gpuio agent keygen`.
pub fn keygen(args: &AgentArgs) -> Result<(), Error> {
    let Some(AgentCommand::Keygen { out }) = &args.command else {
        return Err(Error::Invalid("not `gpuio agent keygen`".into()));
    };
    let secret = gpuio_transport_remoteio::auth::generate_secret()
        .map_err(|e| Error::Invalid(format!("no random bytes from the operating system: {e}")))?;
    match out {
        None => println!("{secret}"),
        Some(path) => {
            write_new_private(path, format!("{secret}\n").as_bytes())?;
            eprintln!(
                "wrote a new secret to {} (mode 0600); name it in secret_file",
                escape_path(path)
            );
        }
    }
    Ok(())
}

/// Creates `path` (never over an existing file, nor through a symlink) readable and writable
/// by its owner only, and writes `bytes`; removes it again if the write fails.
fn write_new_private(path: &Path, bytes: &[u8]) -> Result<(), Error> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let fail = |e: std::io::Error| {
        let why = if e.kind() == std::io::ErrorKind::AlreadyExists {
            "it exists already (a secret is never overwritten)".to_string()
        } else {
            e.to_string()
        };
        Error::Invalid(format!("cannot write {}: {why}", path.display()))
    };
    // create_new is O_CREAT | O_EXCL: no existing file or symlink is followed or replaced.
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(fail)?;
    if let Err(e) = file.write_all(bytes).and_then(|()| file.sync_all()) {
        drop(file);
        let _ = std::fs::remove_file(path);
        return Err(fail(e));
    }
    Ok(())
}

pub fn run(config: Config, _args: &AgentArgs) -> Result<(), Error> {
    let cfg = config.agent_config()?;
    if cfg.keys.is_empty() || cfg.exports.is_empty() {
        return Err(Error::Invalid(
            "the [agent] section has no keys or no exports: nothing would be served \
             (see `gpuio info --show-config`)"
                .into(),
        ));
    }
    let names: Vec<String> = cfg
        .exports
        .iter()
        .map(|e| escape(&e.name).into_owned())
        .collect();
    let plain = cfg.tls.is_none();
    let files = cfg
        .exports
        .iter()
        .filter(|e| {
            matches!(
                e.source,
                gpuio_transport_remoteio::ExportSource::File { .. }
            )
        })
        .count();
    check_descriptors(cfg.max_handshakes + cfg.max_connections, files)?;
    let agent = Agent::start(cfg)?;
    if plain && !agent.local_addr().ip().is_loopback() {
        eprintln!(
            "warning: serving plain TCP on {}: keys are proven, but the messages after the \
             handshake can be read or changed by anyone on the path; set [agent] tls_cert and \
             tls_key on networks you do not trust",
            agent.local_addr()
        );
    }
    // The first line says where it listens (port 0 in the configuration picks one).
    println!("gpuio agent listening on {}", agent.local_addr());
    println!("exports: {}", names.join(", "));
    {
        let _registered = register(&config, &agent)?;
        wait_for_signal()?;
        // Leaving this scope leaves the registry first, so no new client is sent here while
        // we drain.
    }
    eprintln!("stopping: finishing the requests in flight");
    let stats = agent.shutdown();
    println!(
        "served {} requests ({} refused) in {} sessions ({} refused, {} protocol errors); \
         {} bytes read, {} written",
        stats.served,
        stats.refused,
        stats.sessions,
        stats.refused_sessions,
        stats.protocol_errors,
        stats.bytes_read,
        stats.bytes_written
    );
    Ok(())
}

/// Raises the descriptor limit as far as it goes, and refuses a configuration whose
/// connections (pending handshakes and sessions) and file exports (each held open) could not
/// all have one: past the limit, the agent could accept no one, good clients included.
fn check_descriptors(connections: usize, file_exports: usize) -> Result<(), Error> {
    let limit = gpuio_hal::raise_fd_limit()
        .map_err(|e| Error::Invalid(format!("reading the file descriptor limit: {e}")))?;
    descriptors_suffice(connections, file_exports, limit)
}

/// Whether `limit` descriptors hold the connections, the file exports and a margin.
fn descriptors_suffice(connections: usize, file_exports: usize, limit: u64) -> Result<(), Error> {
    // The runtime, the registry, logging, the spare kept for refusing clients when short.
    const MARGIN: u64 = 64;
    let needed = (connections as u64)
        .saturating_add(file_exports as u64)
        .saturating_add(MARGIN);
    if needed > limit {
        return Err(Error::Invalid(format!(
            "[agent] max_handshakes + max_connections = {connections} connections and \
             {file_exports} file exports need {needed} descriptors, but this process may open \
             only {limit} (ulimit -n; raise its hard limit, or lower the settings or the \
             exports)"
        )));
    }
    Ok(())
}

/// The exports whose NIXL metadata the agent publishes: each one's name and JSON line.
fn nixl_published(agent: &Agent) -> Vec<(String, String)> {
    #[cfg(feature = "nixl")]
    return agent.nixl_published();
    #[cfg(not(feature = "nixl"))]
    {
        let _ = agent;
        Vec::new()
    }
}

/// What the agent keeps in the registry while it runs, each key revoked when dropped: its
/// segment registration, and its published NIXL exports (`nixl_publish`).
#[cfg(feature = "registry")]
fn register(
    config: &Config,
    agent: &Agent,
) -> Result<Vec<gpuio_transport_remoteio::SegmentRegistration>, Error> {
    use gpuio_transport_remoteio::{Registry, SegmentMember};
    use std::time::Duration;
    let a = &config.agent;
    let published = nixl_published(agent);
    if a.segment.is_empty() && published.is_empty() {
        return Ok(Vec::new());
    }
    let registry = config.registry_config().ok_or_else(|| {
        Error::Invalid(
            "[agent] segment and nixl_publish need a registry: set [remote] registry".into(),
        )
    })?;
    let addr = if a.advertise.is_empty() {
        agent.local_addr()
    } else {
        a.advertise.parse().map_err(|_| {
            Error::Invalid(format!(
                "[agent] advertise {:?} is not host:port",
                a.advertise
            ))
        })?
    };
    let name = if a.name.is_empty() {
        addr.to_string()
    } else {
        a.name.clone()
    };
    let ttl = Duration::from_secs(a.lease_ttl_s);
    let prefix = registry.prefix.clone();
    let registry = Registry::connect(registry)?;
    let mut kept = Vec::new();
    if !a.segment.is_empty() {
        let member = SegmentMember {
            agent: name.clone(),
            addr,
        };
        kept.push(registry.register(&a.segment, &member, ttl)?);
        println!("registered as {name} in segment {}", a.segment);
    }
    for (export, json) in published {
        kept.push(registry.publish_nixl(&name, &export, &json, ttl)?);
        println!("published the NIXL metadata of {export} at {prefix}/nixl/{name}/{export}");
    }
    Ok(kept)
}

/// Without the registry, an agent with a segment or NIXL exports to publish refuses to start
/// rather than serve unlisted.
#[cfg(not(feature = "registry"))]
fn register(config: &Config, agent: &Agent) -> Result<Vec<std::convert::Infallible>, Error> {
    let a = &config.agent;
    if a.segment.is_empty() && nixl_published(agent).is_empty() {
        return Ok(Vec::new());
    }
    Err(Error::Unsupported {
        what: "[agent] segment, nixl_publish".into(),
        reason: gpuio_api::REGISTRY_ABSENT.into(),
    })
}

fn wait_for_signal() -> Result<(), Error> {
    wait_for_signal_ticking(std::time::Duration::MAX, &mut || Ok(()))
}

/// Waits for SIGINT or SIGTERM, calling `tick` every `every` meanwhile (its error ends the
/// wait).
pub(crate) fn wait_for_signal_ticking(
    every: std::time::Duration,
    tick: &mut dyn FnMut() -> Result<(), Error>,
) -> Result<(), Error> {
    let io = |e: std::io::Error| Error::Invalid(format!("waiting for a signal: {e}"));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()
        .map_err(io)?;
    rt.block_on(async {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate()).map_err(io)?;
        let mut int = signal(SignalKind::interrupt()).map_err(io)?;
        // A year stands for "never" (tokio's timer takes no larger deadline).
        let period = every.min(std::time::Duration::from_secs(365 * 86_400));
        let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        loop {
            tokio::select! {
                _ = term.recv() => return Ok(()),
                _ = int.recv() => return Ok(()),
                _ = ticks.tick() => tick()?,
            }
        }
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn file_exports_count_against_the_descriptor_limit() {
        assert!(super::descriptors_suffice(768, 100, 1024).is_ok());
        let e = super::descriptors_suffice(768, 19_900, 20_000).unwrap_err();
        assert!(e.to_string().contains("19900 file exports"), "{e}");
    }
}
