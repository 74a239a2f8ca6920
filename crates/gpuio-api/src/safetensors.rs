//! The header of a safetensors checkpoint: an 8-byte little-endian length, that many bytes of
//! JSON (`dtype`, `shape` and `data_offsets` of each tensor, an optional `__metadata__` map of
//! strings), then the tensors' bytes.
//!
//! The JSON is read entry by entry and checked by the `safetensors` crate's own `Metadata` (the
//! rules its loaders apply: offsets contiguous from 0, each tensor's byte length its shape ×
//! dtype, no overflow; a name given twice is refused too). This module bounds what it reads
//! before that (a header of at most [`MAX_HEADER_BYTES`], within the file) and checks the
//! file's length after it (the data ends where the file ends), so a loader that trusts
//! [`SafetensorsHeader`] reads only bytes the file has, into tensors whose sizes are right.

use crate::error::{Error, Result, escape_path};
use safetensors::tensor::{Metadata, TensorInfo};
use std::collections::HashMap;
use std::io::Read;
use std::ops::Range;
use std::path::Path;

pub use safetensors::Dtype;

/// The largest header read (the `safetensors` crate's own bound, 100 MB).
pub const MAX_HEADER_BYTES: u64 = 100_000_000;

/// One tensor of a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorEntry {
    /// Its name.
    pub name: String,
    /// Its element type.
    pub dtype: Dtype,
    /// Its shape (empty: a scalar).
    pub shape: Vec<usize>,
    /// Its bytes, relative to [`SafetensorsHeader::data_start`].
    pub bytes: Range<u64>,
}

/// A checked safetensors header.
#[derive(Debug, Clone)]
pub struct SafetensorsHeader {
    /// Where the tensors' bytes start in the file (8 + the header's length).
    pub data_start: u64,
    /// The tensors, in file order.
    pub tensors: Vec<TensorEntry>,
    /// The `__metadata__` map, where the header has one.
    pub metadata: Option<HashMap<String, String>>,
}

impl SafetensorsHeader {
    /// Reads and checks the header of the safetensors file at `path`.
    pub fn read(path: &Path) -> Result<Self> {
        let bad = |problem: String| Error::Safetensors {
            path: escape_path(path),
            problem,
        };
        let mut file = std::fs::File::open(path).map_err(|e| bad(e.to_string()))?;
        let meta = file.metadata().map_err(|e| bad(e.to_string()))?;
        if !meta.is_file() {
            return Err(bad("not a regular file".into()));
        }
        let mut prefix = [0u8; 8];
        file.read_exact(&mut prefix)
            .map_err(|_| bad(format!("{} bytes: no 8-byte header length", meta.len())))?;
        let len = u64::from_le_bytes(prefix);
        if len > MAX_HEADER_BYTES || len > meta.len() - 8 {
            return Err(bad(format!(
                "a header of {len} bytes (the file has {}, the most read is {MAX_HEADER_BYTES})",
                meta.len() - 8
            )));
        }
        let mut json = Vec::new();
        (&mut file)
            .take(len)
            .read_to_end(&mut json)
            .map_err(|e| bad(e.to_string()))?;
        if json.len() as u64 != len {
            return Err(bad(format!(
                "the file ends {} bytes into its {len}-byte header",
                json.len()
            )));
        }
        Self::parse(&json, meta.len()).map_err(bad)
    }

    /// Checks `json` (the header's bytes) as the header of a file of `file_len` bytes.
    pub fn parse(json: &[u8], file_len: u64) -> std::result::Result<Self, String> {
        let data_start = 8 + json.len() as u64;
        let header: RawHeader =
            serde_json::from_slice(json).map_err(|e| format!("its header: {e}"))?;
        let RawHeader {
            metadata,
            mut tensors,
        } = header;
        // In file order, as the crate's own parse puts them; then its checks.
        tensors.sort_by_key(|(_, info)| info.data_offsets);
        let checked =
            Metadata::new(metadata, tensors.clone()).map_err(|e| format!("its header: {e}"))?;
        // Two tensors cannot share a name (the crate's index keeps one of them).
        let mut names = std::collections::HashSet::with_capacity(tensors.len());
        if let Some((name, _)) = tensors
            .iter()
            .find(|(name, _)| !names.insert(name.as_str()))
        {
            return Err(format!("its header: tensor {name:?} is named twice"));
        }
        let data_len = checked.data_len() as u64;
        if data_start.checked_add(data_len) != Some(file_len) {
            return Err(format!(
                "its tensors end at byte {} but the file has {file_len}",
                data_start.saturating_add(data_len)
            ));
        }
        let tensors = tensors
            .into_iter()
            .map(|(name, info)| {
                let (begin, end) = info.data_offsets;
                TensorEntry {
                    dtype: info.dtype,
                    shape: info.shape,
                    bytes: begin as u64..end as u64,
                    name,
                }
            })
            .collect();
        Ok(Self {
            data_start,
            tensors,
            metadata: checked.metadata().clone(),
        })
    }

    /// The bytes of all the tensors together.
    pub fn data_len(&self) -> u64 {
        self.tensors.last().map_or(0, |t| t.bytes.end)
    }

    /// The tensor named `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorEntry> {
        self.tensors.iter().find(|t| t.name == name)
    }
}

/// A header as its JSON gives it: the `__metadata__` map, and each tensor's name and info.
/// Read entry by entry (the crate's own `Metadata` goes through serde's buffered `flatten`,
/// more than twice as slow for thousands of tensors); its `Metadata::new` checks the result.
struct RawHeader {
    metadata: Option<HashMap<String, String>>,
    tensors: Vec<(String, TensorInfo)>,
}

impl<'de> serde::Deserialize<'de> for RawHeader {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct Entries;
        impl<'de> serde::de::Visitor<'de> for Entries {
            type Value = RawHeader;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a map of tensor names to their dtype, shape and data_offsets")
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> std::result::Result<RawHeader, A::Error> {
                let mut out = RawHeader {
                    metadata: None,
                    tensors: Vec::with_capacity(map.size_hint().unwrap_or(0).min(1 << 16)),
                };
                let mut seen_metadata = false;
                while let Some(key) = map.next_key::<String>()? {
                    if key == "__metadata__" {
                        if std::mem::replace(&mut seen_metadata, true) {
                            return Err(serde::de::Error::duplicate_field("__metadata__"));
                        }
                        out.metadata = map.next_value()?;
                    } else {
                        let info: TensorInfo = map.next_value()?;
                        out.tensors.push((key, info));
                    }
                }
                Ok(out)
            }
        }
        d.deserialize_map(Entries)
    }
}

/// A checkpoint loaded onto a GPU: every tensor's bytes in one allocation, tensor `t` at
/// `t.bytes` of `data`.
#[derive(Debug)]
pub struct LoadedCheckpoint {
    /// The checked header.
    pub header: SafetensorsHeader,
    /// The tensors' bytes (at least one byte long, for a checkpoint of no data).
    pub data: crate::DeviceBuffer,
}

/// Loads the safetensors checkpoint at `path` onto GPU `gpu` of `session`: its header
/// checked first, then all its data in one read through LocalIO, of the file opened
/// read-only as `open` asks (`OpenOptions::READ`, or `.direct()` to read past the page
/// cache: faster from a disk on some machines, but the next load reads the disk again; its
/// `gds` choice too; anything that would write is ignored).
pub fn load_to_device(
    session: &crate::Session,
    path: &Path,
    gpu: u32,
    open: crate::OpenOptions,
) -> Result<LoadedCheckpoint> {
    let header = SafetensorsHeader::read(path)?;
    let len = usize::try_from(header.data_len()).map_err(|_| Error::Safetensors {
        path: escape_path(path),
        problem: "more data than this machine can address".into(),
    })?;
    let data = session.alloc_device(gpu, len.max(1))?;
    if len > 0 {
        let read = crate::OpenOptions {
            direct: open.direct,
            gds: open.gds,
            ..crate::OpenOptions::READ
        };
        let file = session.open_file(path, read)?;
        session
            .localio()
            .read_to_device(&file, header.data_start, &data, 0, len)?;
    }
    Ok(LoadedCheckpoint { header, data })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(header: &str, data: usize) -> tempfile::NamedTempFile {
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        bytes.resize(bytes.len() + data, 7);
        let f = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(f.path(), bytes).unwrap();
        f
    }

    #[test]
    fn a_header_gives_its_tensors_in_file_order() {
        let h = r#"{"b":{"dtype":"F32","shape":[2,2],"data_offsets":[4,20]},
                    "a":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]},
                    "__metadata__":{"format":"pt"}}"#;
        let f = file(h, 20);
        let got = SafetensorsHeader::read(f.path()).unwrap();
        assert_eq!(got.data_start, 8 + h.len() as u64);
        let names: Vec<&str> = got.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["a", "b"]);
        assert_eq!(got.tensor("b").unwrap().shape, [2, 2]);
        assert_eq!(got.tensor("b").unwrap().bytes, 4..20);
        assert_eq!(got.tensor("a").unwrap().dtype, Dtype::BF16);
        assert_eq!(got.data_len(), 20);
        assert_eq!(got.metadata.unwrap()["format"], "pt");
    }

    #[test]
    fn malformed_headers_are_refused_by_name() {
        let t = r#"{"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#;
        for (header, data, needle) in [
            (t, 7, "end at byte"),
            (t, 9, "end at byte"),
            (
                r#"{"t":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#,
                8,
                "header",
            ),
            (
                r#"{"t":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#,
                12,
                "header",
            ),
            (
                r#"{"t":{"dtype":"X9","shape":[2],"data_offsets":[0,8]}}"#,
                8,
                "header",
            ),
            (
                r#"{"t":{"dtype":"U8","shape":[18446744073709551615,2],"data_offsets":[0,8]}}"#,
                8,
                "header",
            ),
            (
                r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},
                    "b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}}"#,
                6,
                "header",
            ),
            ("[1,2]", 0, "header"),
            ("{\"t\":", 0, "header"),
            // A name twice, whether or not the second's bytes follow the first's.
            (
                r#"{"t":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},
                    "t":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}}"#,
                8,
                "named twice",
            ),
            (
                r#"{"t":{"dtype":"U8","shape":[0],"data_offsets":[0,0]},
                    "t":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}"#,
                0,
                "named twice",
            ),
            (
                r#"{"__metadata__":{},"__metadata__":{},
                    "t":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}"#,
                4,
                "__metadata__",
            ),
            (
                r#"{"__metadata__":{"k":1},"t":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}"#,
                4,
                "header",
            ),
        ] {
            let f = file(header, data);
            let e = SafetensorsHeader::read(f.path()).unwrap_err();
            assert!(matches!(e, Error::Safetensors { .. }), "{e}");
            assert!(e.to_string().contains(needle), "{header}: {e}");
        }
    }

    #[test]
    fn a_checkpoint_loads_onto_a_device_whole() {
        let h = r#"{"a":{"dtype":"U8","shape":[3],"data_offsets":[0,3]},
                    "b":{"dtype":"I32","shape":[5],"data_offsets":[3,23]}}"#;
        let f = file(h, 0);
        let data: Vec<u8> = (0..23u8).map(|i| i.wrapping_mul(37)).collect();
        let mut bytes = std::fs::read(f.path()).unwrap();
        bytes.extend_from_slice(&data);
        std::fs::write(f.path(), bytes).unwrap();
        let s = crate::Session::new(crate::Config::default()).unwrap();
        // Buffered, and with O_DIRECT (the data starts and ends off any block boundary),
        // where the file system takes it (asked of the kernel, not of the code under test).
        let takes_direct = {
            use std::os::unix::fs::OpenOptionsExt;
            let mut o = std::fs::OpenOptions::new();
            o.read(true).custom_flags(libc::O_DIRECT).open(f.path())
        };
        // Options that would write (truncate) are read-only here: the file stays whole.
        let opens = [
            crate::OpenOptions::READ,
            crate::OpenOptions::READ.direct(),
            crate::OpenOptions::CREATE,
        ];
        for open in opens {
            if let (true, Err(e)) = (open.direct, &takes_direct) {
                gpuio_testkit::Requirement::ODirect.missing(format_args!(
                    "the file system of {} refuses O_DIRECT: {e}",
                    f.path().display()
                ));
                continue;
            }
            let got = load_to_device(&s, f.path(), 0, open).unwrap();
            let mut back = vec![0u8; 23];
            s.gpu(0)
                .unwrap()
                .stream()
                .unwrap()
                .download(&got.data, 0, &mut back)
                .unwrap();
            assert_eq!(back, data, "{open:?}");
            assert_eq!(got.header.tensor("b").unwrap().bytes, 3..23);
        }
        std::fs::write(f.path(), &std::fs::read(f.path()).unwrap()[..40]).unwrap();
        assert!(matches!(
            load_to_device(&s, f.path(), 0, crate::OpenOptions::READ),
            Err(Error::Safetensors { .. })
        ));
    }

    #[test]
    fn a_length_past_the_file_or_the_bound_reads_nothing() {
        let dir = tempfile::tempdir().unwrap();
        for (len, body, needle) in [
            (u64::MAX, 0, "header of"),
            (MAX_HEADER_BYTES + 1, 0, "header of"),
            (1000, 10, "header of"),
        ] {
            let p = dir.path().join("x");
            let mut bytes = u64::to_le_bytes(len).to_vec();
            bytes.resize(8 + body, b' ');
            std::fs::write(&p, bytes).unwrap();
            let e = SafetensorsHeader::read(&p).unwrap_err();
            assert!(e.to_string().contains(needle), "{e}");
        }
        std::fs::write(dir.path().join("short"), [1, 2, 3]).unwrap();
        let e = SafetensorsHeader::read(&dir.path().join("short")).unwrap_err();
        assert!(e.to_string().contains("8-byte"), "{e}");
        let e = SafetensorsHeader::read(dir.path()).unwrap_err();
        assert!(e.to_string().contains("regular"), "{e}");
    }
}
