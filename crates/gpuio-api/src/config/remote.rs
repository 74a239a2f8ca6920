//! RemoteIO's configurations built from `[agent]` and `[remote]`: the agent's (addresses
//! parsed, key secrets read, memory exports allocated), the clients' credentials, how they
//! connect to one agent (TLS trust, RDMA), and the segment registry's.

use super::Config;
use super::files::read_secret;
use crate::error::{Error, Result};
use gpuio_transport_remoteio::wire::MAX_DATA;
use gpuio_transport_remoteio::{
    Access, AgentConfig, Credentials, Export, ExportSource, Key, PeerConfig, RegistryConfig, Role,
    TlsClient, TlsServer,
};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

impl Config {
    /// The agent's configuration: addresses parsed, secrets read, memory exports allocated.
    pub fn agent_config(&self) -> Result<AgentConfig> {
        let a = &self.agent;
        let bad = |message: String| Error::Config {
            source_name: self
                .source
                .as_ref()
                .map_or_else(|| "<built-in>".into(), |p| p.display().to_string()),
            message,
        };
        let listen = a
            .listen
            .parse()
            .map_err(|_| bad(format!("agent.listen {:?} is not host:port", a.listen)))?;
        let mut cfg = AgentConfig::new(listen);
        let ms = std::time::Duration::from_millis;
        cfg.handshake_timeout = ms(a.handshake_timeout_ms);
        cfg.max_handshakes = a.max_handshakes;
        cfg.max_handshakes_per_address = a.max_handshakes_per_address;
        cfg.max_connections = a.max_connections;
        cfg.max_sessions_per_key = a.max_sessions_per_key;
        cfg.io_timeout = ms(a.io_timeout_ms);
        cfg.idle_timeout = ms(a.idle_timeout_ms);
        cfg.buffer_memory = a.buffer_memory.as_u64() as usize;
        cfg.threads = a.threads;
        cfg.tls = match (a.tls_cert.is_empty(), a.tls_key.is_empty()) {
            (true, true) => None,
            (false, false) => Some(
                TlsServer::from_pem_files(Path::new(&a.tls_cert), Path::new(&a.tls_key))
                    .map_err(|e| bad(format!("agent TLS: {e}")))?,
            ),
            _ => return Err(bad("agent.tls_cert and agent.tls_key go together".into())),
        };
        if a.nixl {
            #[cfg(feature = "nixl")]
            {
                cfg.nixl = true;
                cfg.nixl_tcp = a.nixl_tcp;
                cfg.nixl_publish = a.nixl_publish.clone();
            }
            #[cfg(not(feature = "nixl"))]
            return Err(bad(
                "agent.nixl: this build has no NIXL (cargo feature `nixl`)".into(),
            ));
        } else if !a.nixl_publish.is_empty() {
            return Err(bad("agent.nixl_publish needs agent.nixl = true".into()));
        }
        if a.rdma {
            #[cfg(feature = "rdma")]
            {
                cfg.rdma = Some(self.rdma_options());
            }
            #[cfg(not(feature = "rdma"))]
            return Err(bad(
                "agent.rdma: this build has no RDMA verbs (cargo feature `rdma`)".into(),
            ));
        }
        for k in &a.keys {
            let role = match k.role.as_str() {
                "read-only" => Role::ReadOnly,
                "read-write" => Role::ReadWrite,
                other => {
                    return Err(bad(format!(
                        "key {:?}: role {other:?} is not read-only or read-write",
                        k.id
                    )));
                }
            };
            let secret = read_secret(&k.id, k.secret_env.as_deref(), k.secret_file.as_deref())
                .map_err(bad)?;
            cfg.keys.push(Key {
                id: k.id.clone(),
                secret,
                role,
            });
        }
        for e in &a.exports {
            let access = match e.access.as_str() {
                "read-only" => Access::ReadOnly,
                "read-write" => Access::ReadWrite,
                other => {
                    return Err(bad(format!(
                        "export {:?}: access {other:?} is not read-only or read-write",
                        e.name
                    )));
                }
            };
            if e.gpu.is_some() && e.memory.is_none() {
                return Err(bad(format!(
                    "export {:?}: gpu goes with memory (its size)",
                    e.name
                )));
            }
            let source = match (&e.file, e.memory) {
                (Some(path), None) => ExportSource::File {
                    path: path.clone(),
                    max_len: e.max_size.map(|s| s.as_u64()),
                },
                (None, Some(size)) => {
                    let len = usize::try_from(size.as_u64())
                        .map_err(|_| bad(format!("export {:?}: too large", e.name)))?;
                    match e.gpu {
                        None => {
                            let buf = gpuio_hal::HostBuffer::alloc(len, &Default::default())?;
                            ExportSource::Memory(gpuio_transport_remoteio::shared_memory(buf))
                        }
                        Some(n) => {
                            let probe = gpuio_hal::probe_with(self.backend, self.host_devices)?;
                            let gpu = probe.gpus.get(n as usize).ok_or_else(|| {
                                bad(format!(
                                    "export {:?}: gpu {n}, but this machine has {} GPUs",
                                    e.name,
                                    probe.gpus.len()
                                ))
                            })?;
                            let buf = gpu.alloc(len)?;
                            // Zeroed, like a host memory export.
                            let zeros = vec![0u8; len.min(64 << 20)];
                            let stream = gpu.stream()?;
                            let mut at = 0;
                            while at < len {
                                let n = (len - at).min(zeros.len());
                                stream.upload(&zeros[..n], &buf, at)?;
                                at += n;
                            }
                            ExportSource::Device(buf)
                        }
                    }
                }
                _ => {
                    return Err(bad(format!(
                        "export {:?}: give exactly one of file, memory",
                        e.name
                    )));
                }
            };
            cfg.exports.push(Export {
                name: e.name.clone(),
                source,
                access,
            });
        }
        Ok(cfg)
    }

    pub(super) fn config_error(&self, message: String) -> Error {
        Error::Config {
            source_name: self
                .source
                .as_ref()
                .map_or_else(|| "<built-in>".into(), |p| p.display().to_string()),
            message,
        }
    }

    /// The credentials RemoteIO clients present (`None`: no `[remote] key_id`).
    pub fn remote_credentials(&self) -> Result<Option<Credentials>> {
        let r = &self.remote;
        if r.key_id.is_empty() {
            return Ok(None);
        }
        let nonempty = |s: &str| (!s.is_empty()).then(|| s.to_string());
        let file = nonempty(&r.secret_file).map(PathBuf::from);
        let secret = read_secret(
            &r.key_id,
            nonempty(&r.secret_env).as_deref(),
            file.as_deref(),
        )
        .map_err(|m| self.config_error(format!("[remote] {m}")))?;
        Ok(Some(Credentials {
            key_id: r.key_id.clone(),
            secret,
        }))
    }

    /// How RemoteIO clients connect to the agent at `addr` (the TLS trust read here), over
    /// RDMA verbs for memory exports when `rdma`.
    pub fn peer_config(
        &self,
        addr: SocketAddr,
        credentials: Credentials,
        transport: crate::RemoteTransport,
    ) -> Result<PeerConfig> {
        let r = &self.remote;
        let mut cfg = PeerConfig::new(addr, credentials);
        // Checked when the configuration was loaded; the clamps keep a hand-built one sane.
        cfg.connections = r.connections.max(1);
        cfg.stripe_bytes = (r.stripe_size.as_u64() as usize).clamp(4096, MAX_DATA);
        cfg.timeout = std::time::Duration::from_millis(r.timeout_ms.max(1));
        if !r.tls_ca.is_empty() {
            cfg.tls = Some(
                TlsClient::from_ca_pem_file(Path::new(&r.tls_ca))
                    .map_err(|e| self.config_error(format!("[remote] tls_ca: {e}")))?,
            );
        }
        if !r.tls_server_name.is_empty() {
            cfg.server_name = Some(r.tls_server_name.clone());
        }
        match transport {
            crate::RemoteTransport::Tcp => {}
            crate::RemoteTransport::Rdma => cfg = self.with_rdma(cfg)?,
            #[cfg(feature = "nixl")]
            crate::RemoteTransport::Nixl => cfg.nixl = true,
            #[cfg(not(feature = "nixl"))]
            crate::RemoteTransport::Nixl => {
                return Err(Error::Unsupported {
                    what: "remoteio transport=nixl".into(),
                    reason: "this build has no NIXL (cargo feature `nixl`); use transport=tcp"
                        .into(),
                });
            }
        }
        Ok(cfg)
    }

    #[cfg(feature = "rdma")]
    fn with_rdma(&self, mut cfg: PeerConfig) -> Result<PeerConfig> {
        cfg.rdma = Some(self.rdma_options());
        Ok(cfg)
    }

    #[cfg(not(feature = "rdma"))]
    fn with_rdma(&self, _cfg: PeerConfig) -> Result<PeerConfig> {
        Err(Error::Unsupported {
            what: "RemoteIO over RDMA".into(),
            reason: "this build has no RDMA verbs (cargo feature `rdma`); use transport=tcp".into(),
        })
    }

    /// The RDMA device `[remote]` names.
    #[cfg(feature = "rdma")]
    pub fn rdma_options(&self) -> gpuio_transport_remoteio::rdma::RdmaOptions {
        let r = &self.remote;
        gpuio_transport_remoteio::rdma::RdmaOptions {
            device: (!r.rdma_device.is_empty()).then(|| r.rdma_device.clone()),
            gid_index: r.rdma_gid_index,
        }
    }

    /// The registry's configuration (`None`: no `[remote] registry`).
    pub fn registry_config(&self) -> Option<RegistryConfig> {
        let r = &self.remote;
        (!r.registry.is_empty()).then(|| RegistryConfig {
            endpoints: r.registry.clone(),
            prefix: r.registry_prefix.clone(),
            timeout: std::time::Duration::from_millis(r.timeout_ms.clamp(100, 10_000)),
        })
    }
}
