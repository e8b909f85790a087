//! Shortest-path routes with equal-cost multipath, and the 5-tuple hash that picks among
//! equal-cost next hops.

use super::link::Link;
use super::NodeId;
use std::collections::{HashMap, VecDeque};

/// No route to the destination from this switch.
pub(crate) const NO_ROUTE: u32 = u32::MAX;

/// A 64-bit finalizer (the SplitMix64 output function): every input bit affects every
/// output bit.
#[inline]
pub(crate) fn mix64(mut x: u64) -> u64 {
    x ^= x >> 30;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Hash of the UDP 5-tuple (protocol 17), computed once per packet; each switch salts it.
#[inline]
pub(crate) fn flow_hash(src_ip: u32, dst_ip: u32, src_port: u16, dst_port: u16) -> u64 {
    let ips = (u64::from(src_ip) << 32) | u64::from(dst_ip);
    let ports = (u64::from(src_port) << 24) | (u64::from(dst_port) << 8) | 17;
    mix64(ips ^ mix64(ports ^ 0x5bd1_e995_7f4a_7c15))
}

/// Pick one of `n` equal-cost choices for a packet with `hash` at a node salted `salt`.
#[inline]
pub(crate) fn pick(hash: u64, salt: u64, n: usize) -> usize {
    ((u128::from(mix64(hash ^ salt)) * n as u128) >> 64) as usize
}

/// Forwarding table of one switch.
#[derive(Debug, Default)]
pub(crate) struct RouteTable {
    /// Per destination host: index into `sets`, or [`NO_ROUTE`].
    pub by_dst: Vec<u32>,
    /// Next-hop sets: ranges of `links`.
    pub sets: Vec<(u32, u32)>,
    /// Outgoing link indices.
    pub links: Vec<u32>,
}

impl RouteTable {
    /// The equal-cost next-hop links towards host `dst`.
    #[inline]
    pub fn next_hops(&self, dst: usize) -> &[u32] {
        match self.by_dst.get(dst) {
            Some(&i) if i != NO_ROUTE => {
                let (start, len) = self.sets[i as usize];
                &self.links[start as usize..(start + len) as usize]
            }
            _ => &[],
        }
    }
}

/// Compute every switch's table: for each destination host, the outgoing links that lie
/// on a shortest path (in hops) through links that are up. Hosts never forward transit
/// traffic, so paths go through switches only.
pub(crate) fn compute(hosts: usize, switches: usize, links: &[Link]) -> Vec<RouteTable> {
    let nodes = hosts + switches;
    let index = |n: NodeId| match n {
        NodeId::Host(h) => h.0 as usize,
        NodeId::Switch(s) => hosts + s.0 as usize,
    };
    let mut incoming: Vec<Vec<u32>> = vec![Vec::new(); nodes];
    let mut outgoing: Vec<Vec<u32>> = vec![Vec::new(); switches];
    for (i, l) in links.iter().enumerate() {
        if !l.up {
            continue;
        }
        incoming[index(l.to)].push(i as u32);
        if let NodeId::Switch(s) = l.from {
            outgoing[s.0 as usize].push(i as u32);
        }
    }
    let mut tables: Vec<RouteTable> = (0..switches)
        .map(|_| RouteTable {
            by_dst: vec![NO_ROUTE; hosts],
            ..Default::default()
        })
        .collect();
    let mut dedup: Vec<HashMap<Box<[u32]>, u32>> = vec![HashMap::new(); switches];
    let mut dist = vec![u32::MAX; nodes];
    let mut queue = VecDeque::new();
    let mut hops = Vec::new();
    for dst in 0..hosts {
        dist.fill(u32::MAX);
        dist[dst] = 0;
        queue.clear();
        queue.push_back(dst);
        while let Some(v) = queue.pop_front() {
            for &l in &incoming[v] {
                let u = index(links[l as usize].from);
                if u >= hosts && dist[u] == u32::MAX {
                    dist[u] = dist[v] + 1;
                    queue.push_back(u);
                }
            }
        }
        for s in 0..switches {
            let d = dist[hosts + s];
            if d == u32::MAX {
                continue;
            }
            hops.clear();
            hops.extend(
                outgoing[s]
                    .iter()
                    .copied()
                    .filter(|&l| dist[index(links[l as usize].to)] == d - 1),
            );
            let table = &mut tables[s];
            let set = match dedup[s].get(&hops[..]) {
                Some(&i) => i,
                None => {
                    let i = table.sets.len() as u32;
                    table
                        .sets
                        .push((table.links.len() as u32, hops.len() as u32));
                    table.links.extend_from_slice(&hops);
                    dedup[s].insert(hops.clone().into_boxed_slice(), i);
                    i
                }
            };
            table.by_dst[dst] = set;
        }
    }
    tables
}
