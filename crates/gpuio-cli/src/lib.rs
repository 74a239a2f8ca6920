//! The library side of the `gpuio` command: what it parses from peers, kept here so that tests
//! and the fuzz targets reach it as the command does.

#![forbid(unsafe_code)]

pub mod exposition;
