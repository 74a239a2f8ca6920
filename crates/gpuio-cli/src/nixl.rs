//! `gpuio nixl-export URI`: an export's NIXL metadata, for a program that speaks NIXL with its
//! own API and no gpuio code. The command authenticates to the agent with the `[remote]` key,
//! asks for the export over NIXL, and writes what a NIXL program needs, one JSON line: the NIXL
//! agent's metadata (hex), the export's address in the agent's process, its length, and the
//! CUDA device whose memory it is (`"gpu"`, null for host memory: NIXL's `VRAM` or `DRAM`). Then it
//! holds the session open, asking the agent for the export's size now and then so that the
//! session is never idle, until SIGINT or SIGTERM: the agent's NIXL side lives as long as the
//! session. Only a key that may write the export gets the metadata (NIXL cannot hold a program
//! to reading), and the metadata reaches that export and nothing else.

use gpuio_api::{Config, Error, RemoteTarget, RemoteTransport, Uri};
use gpuio_transport_remoteio::Connection;
use std::io::Write;
use std::net::ToSocketAddrs;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Debug, clap::Args)]
pub struct NixlExportArgs {
    /// The export, `remoteio://host:port/<export>`.
    uri: String,
    /// Write the JSON line to FILE, a new file private to its owner (it is a credential),
    /// instead of standard output.
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
}

/// How often the held session asks the agent something (well within its idle timeout).
const KEEPALIVE: Duration = Duration::from_secs(20);

pub fn run(config: Config, args: &NixlExportArgs) -> Result<(), Error> {
    let uri = Uri::parse(&args.uri)?;
    let Uri::Remote {
        target: RemoteTarget::Address { host, port },
        resource,
        ..
    } = &uri
    else {
        return Err(Error::Invalid(format!(
            "{uri}: nixl-export takes a remoteio://host:port/<export> URI"
        )));
    };
    let addr = (host.as_str(), *port)
        .to_socket_addrs()
        .map_err(|e| Error::Invalid(format!("{uri}: {host}: {e}")))?
        .next()
        .ok_or_else(|| Error::Invalid(format!("{uri}: {host} has no address")))?;
    let creds = config.remote_credentials()?.ok_or_else(|| {
        Error::Invalid(format!(
            "{uri}: RemoteIO needs a key: set [remote] key_id and secret_env or secret_file"
        ))
    })?;
    let peer = config.peer_config(addr, creds.clone(), RemoteTransport::Tcp)?;
    let tls = peer
        .tls
        .as_ref()
        .map(|t| (t, peer.server_name.as_deref().unwrap_or(host.as_str())));
    let remote = |e: gpuio_transport_remoteio::RemoteIoError| Error::from(e);
    let mut control = Connection::connect_with(addr, &creds, peer.timeout, tls).map_err(remote)?;
    let size = control.stat(resource).map_err(remote)?.size;
    let offer = control.nixl_exchange(resource).map_err(remote)?;
    let line = offer.to_json(size) + "\n";
    match &args.out {
        Some(path) => {
            use std::os::unix::fs::OpenOptionsExt;
            // A new file only: one that exists (or a link planted in its place) keeps
            // whatever mode and target it has, which a credential must not inherit.
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(path)
                .map_err(|e| {
                    Error::Invalid(format!("{}: {e} (--out makes a new file)", path.display()))
                })?;
            f.write_all(line.as_bytes())
                .map_err(|e| Error::Invalid(format!("{}: {e}", path.display())))?;
        }
        None => {
            let mut out = std::io::stdout().lock();
            out.write_all(line.as_bytes())
                .and_then(|()| out.flush())
                .map_err(|e| Error::Invalid(format!("standard output: {e}")))?;
        }
    }
    let place = offer
        .gpu
        .map_or("host memory".into(), |g| format!("GPU {g}"));
    eprintln!(
        "{uri}: NIXL metadata for {size} bytes at {:#x} ({place}); it works until this \
         command ends (SIGINT or SIGTERM)",
        offer.addr
    );
    crate::agent::wait_for_signal_ticking(KEEPALIVE, &mut || {
        control.stat(resource).map(|_| ()).map_err(remote)
    })
}
