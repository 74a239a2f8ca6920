//! Reading the files a configuration names: configuration files and key secrets are read only
//! when they are small regular files (a FIFO would block the reader forever, a device such as
//! `/dev/zero` never end), secrets only when private to their owner.

use super::MAX_SECRET_BYTES;
use std::path::Path;

/// A key's secret, from exactly one of an environment variable and a file (whose trailing
/// newline is dropped). The file must be a regular file of at most [`MAX_SECRET_BYTES`] that
/// only its owner can read or write, as ssh requires of private keys.
pub(super) fn read_secret(
    key: &str,
    env: Option<&str>,
    file: Option<&Path>,
) -> std::result::Result<Vec<u8>, String> {
    match (env, file) {
        (Some(var), None) => std::env::var(var)
            .map(String::into_bytes)
            .map_err(|_| format!("key {key:?}: ${var} is not set")),
        (None, Some(path)) => {
            let mut bytes = read_small_file(path, MAX_SECRET_BYTES, "secret files", true)
                .map_err(|e| format!("key {key:?}: {}: {e}", path.display()))?;
            while bytes.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
                bytes.pop();
            }
            Ok(bytes)
        }
        _ => Err(format!(
            "key {key:?}: give exactly one of secret_env, secret_file"
        )),
    }
}

/// Reads a small regular file ([`gpuio_transport_remoteio::files::read_small_file`], which
/// says why special files are refused), its error as a message.
pub(super) fn read_small_file(
    path: &Path,
    cap: u64,
    what: &str,
    private: bool,
) -> std::result::Result<Vec<u8>, String> {
    gpuio_transport_remoteio::files::read_small_file(path, cap, what, private)
        .map_err(|e| e.to_string())
}
