//! Compression for the AI tier: lossy KV quantization ([`KvFormat`]: FP16, FP8 E4M3, INT8,
//! 4-bit, with documented error bounds; on the host, or on the GPU by kernels that match the
//! host bit for bit: [`KvFormat::quantize_device`]) and lossless frames for engrams and cold tiers
//! ([`Codec`]: LZ4, ZSTD; verified by crc32c where they arrive), and transfers that carry
//! them to files and other nodes' exports ([`transfer_compressed`], [`read_compressed`]).

mod codec;
mod device;
mod quant;
mod transfer;

pub use codec::{Codec, FRAME_HEADER, FrameInfo, decompress, frame_info};
pub use device::DeviceQuantizedKv;
pub use quant::{KvFormat, QuantizedKv};
pub use transfer::{CHUNK, CompressedReport, read_compressed, transfer_compressed};
