//! Test hosts for the CLI's multi-process tests: network namespaces joined to this one by veth
//! pairs (as root, with iproute2), or loopback where namespaces are refused.

#![allow(dead_code)] // each test file uses its own part

use std::path::Path;
use std::process::{Command, Stdio};

/// Runs a command quietly: whether it succeeded.
pub fn sh(args: &[&str]) -> bool {
    Command::new(args[0])
        .args(&args[1..])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// The test's hosts: network namespaces joined to this one by veth pairs, or loopback.
pub struct Hosts {
    namespaces: Vec<String>,
    /// Names the namespaces and links (`gpuio-<tag><i>`), and picks the subnet.
    tag: &'static str,
    /// Host `i`'s network is 10.`net`.`i`.0/24.
    net: u8,
}

impl Hosts {
    /// `count` hosts, each a namespace of its own where the machine allows it.
    pub fn new(count: usize, tag: &'static str, net: u8) -> Self {
        let mut namespaces = Vec::new();
        for i in 1..=count {
            let (ns, host, peer) = names(tag, i);
            // Leftovers of an interrupted run.
            sh(&["ip", "netns", "del", &ns]);
            sh(&["ip", "link", "del", &host]);
            let ok = sh(&["ip", "netns", "add", &ns])
                && sh(&[
                    "ip", "link", "add", &host, "type", "veth", "peer", "name", &peer,
                ])
                && sh(&["ip", "link", "set", &peer, "netns", &ns])
                && sh(&[
                    "ip",
                    "addr",
                    "add",
                    &format!("10.{net}.{i}.1/24"),
                    "dev",
                    &host,
                ])
                && sh(&["ip", "link", "set", &host, "up"])
                && sh(&[
                    "ip",
                    "netns",
                    "exec",
                    &ns,
                    "ip",
                    "addr",
                    "add",
                    &format!("10.{net}.{i}.2/24"),
                    "dev",
                    &peer,
                ])
                && sh(&["ip", "netns", "exec", &ns, "ip", "link", "set", &peer, "up"])
                && sh(&["ip", "netns", "exec", &ns, "ip", "link", "set", "lo", "up"]);
            namespaces.push(ns);
            if !ok {
                eprintln!("network namespaces are refused here: agents run on loopback ports");
                drop(Self {
                    namespaces,
                    tag,
                    net,
                });
                return Self {
                    namespaces: Vec::new(),
                    tag,
                    net,
                };
            }
        }
        Self {
            namespaces,
            tag,
            net,
        }
    }

    /// Whether the hosts are namespaces (else loopback).
    pub fn isolated(&self) -> bool {
        !self.namespaces.is_empty()
    }

    /// The address this host (the client, etcd) has on agent `i`'s network.
    pub fn host_ip(&self, i: usize) -> String {
        if self.isolated() {
            format!("10.{}.{i}.1", self.net)
        } else {
            "127.0.0.1".into()
        }
    }

    /// Agent `i`'s address.
    pub fn agent_ip(&self, i: usize) -> String {
        if self.isolated() {
            format!("10.{}.{i}.2", self.net)
        } else {
            "127.0.0.1".into()
        }
    }

    /// The network interface this host reaches agent `i` through (its veth, or `lo`): what
    /// a UCX on this side may use, where the machine's other interfaces come and go with the
    /// other tests' hosts.
    pub fn host_link(&self, i: usize) -> String {
        if self.isolated() {
            names(self.tag, i).1
        } else {
            "lo".into()
        }
    }

    /// Agent `i`'s interface towards this host.
    pub fn agent_link(&self, i: usize) -> String {
        if self.isolated() {
            names(self.tag, i).2
        } else {
            "lo".into()
        }
    }

    /// A command run on agent `i`'s host.
    pub fn command(&self, i: usize, program: &Path) -> Command {
        if self.isolated() {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", &self.namespaces[i - 1]])
                .arg(program);
            c
        } else {
            Command::new(program)
        }
    }

    /// Cuts (or restores) agent `i`'s link.
    pub fn link(&self, i: usize, up: bool) {
        let (_, host, _) = names(self.tag, i);
        assert!(sh(&[
            "ip",
            "link",
            "set",
            &host,
            if up { "up" } else { "down" }
        ]));
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for (i, ns) in self.namespaces.iter().enumerate() {
            sh(&["ip", "link", "del", &names(self.tag, i + 1).1]);
            sh(&["ip", "netns", "del", ns]);
        }
    }
}

fn names(tag: &str, i: usize) -> (String, String, String) {
    (
        format!("gpuio-{tag}{i}"),
        format!("gp{tag}{i}h"),
        format!("gp{tag}{i}p"),
    )
}
