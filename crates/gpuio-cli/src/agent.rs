//! `gpuio agent`: serves this node's exports (the `[agent]` section of the configuration) to
//! other nodes over RemoteIO until SIGINT or SIGTERM, then shuts down gracefully: the requests
//! in flight finish, and what was served is printed.
//!
//! With `[agent] segment` set, the agent registers in the registry (`[remote] registry`) as
//! serving that segment, under a lease it renews; the registration is revoked at shutdown
//! (and expires on its own if the agent dies).

use gpuio_api::{Config, Error};
use gpuio_transport_remoteio::Agent;

/// Arguments of `gpuio agent` (the agent is configured by `--config FILE`, `[agent]`).
#[derive(Debug, clap::Args)]
pub struct AgentArgs {}

pub fn run(config: Config, _args: &AgentArgs) -> Result<(), Error> {
    let cfg = config.agent_config()?;
    if cfg.keys.is_empty() || cfg.exports.is_empty() {
        return Err(Error::Invalid(
            "the [agent] section has no keys or no exports: nothing would be served \
             (see `gpuio info --show-config`)"
                .into(),
        ));
    }
    let names: Vec<String> = cfg.exports.iter().map(|e| e.name.clone()).collect();
    let agent = Agent::start(cfg)?;
    // The first line says where it listens (port 0 in the configuration picks one).
    println!("gpuio agent listening on {}", agent.local_addr());
    println!("exports: {}", names.join(", "));
    let registration = register(&config, agent.local_addr())?;
    wait_for_signal()?;
    // Leave the registry first, so no new client is sent here while we drain.
    drop(registration);
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

/// Registers the agent's segment, when it has one.
#[cfg(feature = "registry")]
fn register(
    config: &Config,
    listening: std::net::SocketAddr,
) -> Result<Option<gpuio_transport_remoteio::Registration>, Error> {
    use gpuio_transport_remoteio::{Registry, SegmentMember};
    use std::time::Duration;
    let a = &config.agent;
    if a.segment.is_empty() {
        return Ok(None);
    }
    let registry = config.registry_config().ok_or_else(|| {
        Error::Invalid(format!(
            "[agent] segment {:?} needs a registry: set [remote] registry",
            a.segment
        ))
    })?;
    let addr = if a.advertise.is_empty() {
        listening
    } else {
        a.advertise.parse().map_err(|_| {
            Error::Invalid(format!(
                "[agent] advertise {:?} is not host:port",
                a.advertise
            ))
        })?
    };
    let member = SegmentMember {
        agent: if a.name.is_empty() {
            addr.to_string()
        } else {
            a.name.clone()
        },
        addr,
    };
    let registration = Registry::connect(registry)?.register(
        &a.segment,
        &member,
        Duration::from_secs(a.lease_ttl_s),
    )?;
    println!("registered as {} in segment {}", member.agent, a.segment);
    Ok(Some(registration))
}

/// No registration can exist in a build without the registry.
#[cfg(not(feature = "registry"))]
enum Unregistered {}

/// Without the registry, an agent with a segment refuses to start rather than serve unlisted.
#[cfg(not(feature = "registry"))]
fn register(
    config: &Config,
    _listening: std::net::SocketAddr,
) -> Result<Option<Unregistered>, Error> {
    if config.agent.segment.is_empty() {
        return Ok(None);
    }
    Err(Error::Unsupported {
        what: format!("[agent] segment {:?}", config.agent.segment),
        reason: gpuio_api::REGISTRY_ABSENT.into(),
    })
}

fn wait_for_signal() -> Result<(), Error> {
    let io = |e: std::io::Error| Error::Invalid(format!("waiting for a signal: {e}"));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .map_err(io)?;
    rt.block_on(async {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        Ok::<(), std::io::Error>(())
    })
    .map_err(io)
}
