//! One module per parser family; each exports its [`Target`](crate::Target)s.

pub mod config;
pub mod cufile;
pub mod extents;
pub mod frames;
pub mod metrics;
pub mod nvme;
pub mod nvme_controller;
pub mod safetensors;
pub mod sysfs;
pub mod uri;
pub mod wire;
