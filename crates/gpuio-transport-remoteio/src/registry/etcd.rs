//! The registry on etcd (cargo feature `registry`; etcd-client's build runs protoc).

use super::{RegistryConfig, SegmentMember};
use crate::{RemoteIoError, Result};
use etcd_client::{
    Client, ConnectOptions, GetOptions, LeaseKeepAliveStream, LeaseKeeper, PutOptions,
};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// A connection to the registry. Cheap to share behind an `Arc`.
pub struct Registry {
    runtime: Arc<tokio::runtime::Runtime>,
    client: Client,
    cfg: RegistryConfig,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("endpoints", &self.cfg.endpoints)
            .field("prefix", &self.cfg.prefix)
            .finish()
    }
}

fn etcd(e: etcd_client::Error) -> RemoteIoError {
    RemoteIoError::Registry(e.to_string())
}

impl Registry {
    /// Connects to etcd.
    pub fn connect(cfg: RegistryConfig) -> Result<Self> {
        if cfg.endpoints.is_empty() {
            return Err(RemoteIoError::InvalidArgument(
                "the registry needs at least one etcd endpoint".into(),
            ));
        }
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("gpuio-registry")
            .enable_io()
            .enable_time()
            .build()?;
        let opts = ConnectOptions::new()
            .with_connect_timeout(cfg.timeout)
            .with_timeout(cfg.timeout);
        let client = runtime
            .block_on(Client::connect(&cfg.endpoints, Some(opts)))
            .map_err(etcd)?;
        Ok(Self {
            runtime: Arc::new(runtime),
            client,
            cfg,
        })
    }

    fn segment_prefix(&self, segment: &str) -> String {
        format!("{}/segments/{segment}/", self.cfg.prefix)
    }

    /// The agents serving `segment` now (possibly none).
    pub fn resolve(&self, segment: &str) -> Result<Vec<SegmentMember>> {
        check_name("segment", segment)?;
        let prefix = self.segment_prefix(segment);
        let mut client = self.client.clone();
        let resp = self
            .runtime
            .block_on(client.get(prefix.as_str(), Some(GetOptions::new().with_prefix())))
            .map_err(etcd)?;
        let mut members = Vec::new();
        for kv in resp.kvs() {
            let (Ok(key), Ok(value)) = (kv.key_str(), kv.value_str()) else {
                continue;
            };
            let agent = key.strip_prefix(&prefix).unwrap_or(key).to_string();
            match value.parse() {
                Ok(addr) => members.push(SegmentMember { agent, addr }),
                Err(_) => {
                    tracing::warn!(%key, %value, "ignoring a registry entry that is not host:port")
                }
            }
        }
        Ok(members)
    }

    /// Registers `member` as serving `segment` under a lease of `ttl`, kept alive until the
    /// returned [`SegmentRegistration`] is dropped (which revokes it).
    pub fn register(
        &self,
        segment: &str,
        member: &SegmentMember,
        ttl: Duration,
    ) -> Result<SegmentRegistration> {
        check_name("segment", segment)?;
        check_name("agent", &member.agent)?;
        let key = format!("{}{}", self.segment_prefix(segment), member.agent);
        self.keep(key, member.addr.to_string(), ttl)
    }

    fn nixl_key(&self, agent: &str, export: &str) -> Result<String> {
        check_name("agent", agent)?;
        check_name("export", export)?;
        Ok(format!("{}/nixl/{agent}/{export}", self.cfg.prefix))
    }

    /// Publishes `export`'s NIXL description (`json`, [`NixlOffer::to_json`]'s line) as
    /// `agent`'s, under a lease of `ttl` kept alive until the returned registration is dropped.
    /// Whoever can read the registry can then read and write the export: trusted fabrics only.
    ///
    /// [`NixlOffer::to_json`]: crate::NixlOffer::to_json
    pub fn publish_nixl(
        &self,
        agent: &str,
        export: &str,
        json: &str,
        ttl: Duration,
    ) -> Result<SegmentRegistration> {
        self.keep(self.nixl_key(agent, export)?, json.to_string(), ttl)
    }

    /// The NIXL description `agent` publishes for `export`, if it does.
    pub fn published_nixl(&self, agent: &str, export: &str) -> Result<Option<String>> {
        let key = self.nixl_key(agent, export)?;
        let mut client = self.client.clone();
        let resp = self
            .runtime
            .block_on(client.get(key.as_str(), None))
            .map_err(etcd)?;
        Ok(resp
            .kvs()
            .first()
            .map(|kv| String::from_utf8_lossy(kv.value()).into_owned()))
    }

    /// Puts `key` = `value` under a new lease of `ttl`, kept alive in the background.
    fn keep(&self, key: String, value: String, ttl: Duration) -> Result<SegmentRegistration> {
        let ttl_s = ttl.as_secs().max(2) as i64;
        let mut client = self.client.clone();
        let lease = self
            .runtime
            .block_on(put_under_new_lease(&mut client, &key, &value, ttl_s))?;
        let (stop, stopped) = watch::channel(false);
        let keeper = self.runtime.spawn(keep_alive(
            client.clone(),
            key.clone(),
            value,
            ttl_s,
            lease,
            stopped,
        ));
        Ok(SegmentRegistration {
            runtime: self.runtime.clone(),
            client,
            key,
            stop,
            keeper: Some(keeper),
        })
    }
}

/// Segment and agent names become key components: no separators, nothing empty.
fn check_name(what: &str, name: &str) -> Result<()> {
    if name.is_empty() || name.len() > 255 || name.contains('/') {
        return Err(RemoteIoError::InvalidArgument(format!(
            "{what} name {name:?} must be 1 to 255 bytes without '/'"
        )));
    }
    Ok(())
}

async fn put_under_new_lease(
    client: &mut Client,
    key: &str,
    value: &str,
    ttl_s: i64,
) -> Result<i64> {
    let lease = client.lease_grant(ttl_s, None).await.map_err(etcd)?.id();
    client
        .put(key, value, Some(PutOptions::new().with_lease(lease)))
        .await
        .map_err(etcd)?;
    Ok(lease)
}

/// Renews the lease every third of its TTL. If etcd was unreachable for longer than the TTL
/// (the lease expired and the key is gone), registers again under a new lease as soon as etcd
/// answers. Ends by revoking the lease when told to stop.
async fn keep_alive(
    mut client: Client,
    key: String,
    value: String,
    ttl_s: i64,
    mut lease: i64,
    mut stop: watch::Receiver<bool>,
) {
    let period = Duration::from_millis((ttl_s as u64 * 1000 / 3).max(200));
    // One keep-alive stream serves every renewal; it is opened again only after a failure.
    let mut stream: Option<(LeaseKeeper, LeaseKeepAliveStream)> = None;
    loop {
        let renewed = async {
            if stream.is_none() {
                stream = Some(client.lease_keep_alive(lease).await?);
            }
            let Some((keeper, answers)) = stream.as_mut() else {
                return Ok(0);
            };
            keeper.keep_alive().await?;
            Ok::<_, etcd_client::Error>(answers.message().await?.map_or(0, |a| a.ttl()))
        };
        // A cut network can leave the stream silent: a renewal gets one period to answer.
        match tokio::time::timeout(period, renewed).await {
            Ok(Ok(ttl)) if ttl > 0 => {}
            outcome => {
                match &outcome {
                    Ok(Err(e)) => tracing::warn!(%key, error = %e, "renewing the lease failed"),
                    Err(_) => tracing::warn!(%key, "renewing the lease got no answer in time"),
                    Ok(Ok(_)) => {}
                }
                stream = None;
                // Expired (TTL 0), the stream ended, or unknown: the key may be gone; put it
                // back under a new lease.
                match put_under_new_lease(&mut client, &key, &value, ttl_s).await {
                    Ok(l) => lease = l,
                    Err(e) => tracing::warn!(%key, error = %e, "registering again failed"),
                }
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(period) => {}
            _ = stop.changed() => break,
        }
    }
    if let Err(e) = client.lease_revoke(lease).await {
        tracing::info!(%key, error = %e, "revoking the registry lease failed; it will expire");
    }
}

/// A key kept in the registry under a lease renewed in the background: a segment
/// registration, or a published NIXL description. Dropping it revokes the lease, so the key
/// disappears from the registry at once.
pub struct SegmentRegistration {
    runtime: Arc<tokio::runtime::Runtime>,
    client: Client,
    key: String,
    stop: watch::Sender<bool>,
    keeper: Option<tokio::task::JoinHandle<()>>,
}

impl std::fmt::Debug for SegmentRegistration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SegmentRegistration")
            .field("key", &self.key)
            .finish()
    }
}

impl SegmentRegistration {
    /// The registry key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Whether the key is in the registry now.
    pub fn is_registered(&self) -> Result<bool> {
        let mut client = self.client.clone();
        let resp = self
            .runtime
            .block_on(client.get(self.key.as_str(), None))
            .map_err(etcd)?;
        Ok(!resp.kvs().is_empty())
    }
}

impl Drop for SegmentRegistration {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        if let Some(k) = self.keeper.take() {
            let _ = self
                .runtime
                .block_on(async { tokio::time::timeout(Duration::from_secs(5), k).await });
        }
    }
}
