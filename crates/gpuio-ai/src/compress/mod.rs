//! Compression for the AI tier: lossy KV quantization ([`KvFormat`]: FP16, FP8 E4M3, INT8,
//! 4-bit, with documented error bounds) and lossless frames for engrams and cold tiers
//! ([`Codec`]: LZ4, ZSTD; verified by crc32c where they arrive).

mod codec;
mod quant;

pub use codec::{Codec, FrameInfo, decompress, frame_info};
pub use quant::{KvFormat, QuantizedKv};
