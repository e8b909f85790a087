//! Builders of common data-center topologies. Each adds its hosts, switches and links to a
//! [`Sim`] and returns handles to all of them, so that tests can watch or impair a
//! particular link. Hosts get the next free addresses and the
//! [`Sim::set_host_config`] hook, like [`Sim::add_host`].

use super::{HostId, LinkConfig, LinkId, LinkPair, Sim, SwitchId};

/// A two-tier leaf-spine (folded Clos) made by [`Sim::leaf_spine`]: every leaf connects to
/// every spine; hosts hang off the leaves.
#[derive(Debug, Clone)]
pub struct LeafSpine {
    /// Hosts, leaf by leaf: host `i` of leaf `l` is `hosts[l * hosts_per_leaf + i]`.
    pub hosts: Vec<HostId>,
    /// Leaf (top-of-rack) switches.
    pub leaves: Vec<SwitchId>,
    /// Spine switches.
    pub spines: Vec<SwitchId>,
    /// Per host (same order as `hosts`): `forward` is host → leaf.
    pub host_links: Vec<LinkPair>,
    /// `fabric_links[leaf][spine]`: `forward` is leaf → spine.
    pub fabric_links: Vec<Vec<LinkPair>>,
}

impl LeafSpine {
    /// The leaf a host hangs off (`None` for a host not in this topology).
    pub fn leaf_of(&self, host: HostId) -> Option<usize> {
        let i = self.hosts.iter().position(|&h| h == host)?;
        Some(i / (self.hosts.len() / self.leaves.len()).max(1))
    }

    /// Every link direction from leaves up to spine `spine`.
    pub fn spine_uplinks(&self, spine: usize) -> Vec<LinkId> {
        self.fabric_links.iter().map(|l| l[spine].forward).collect()
    }

    /// Every link direction from spine `spine` down to the leaves.
    pub fn spine_downlinks(&self, spine: usize) -> Vec<LinkId> {
        self.fabric_links.iter().map(|l| l[spine].reverse).collect()
    }
}

/// A k-ary three-tier fat tree made by [`Sim::fat_tree`]: `k` pods of `k/2` edge and `k/2`
/// aggregation switches, `(k/2)²` core switches, `k/2` hosts per edge switch (`k³/4` hosts).
/// Aggregation switch `a` of every pod connects to core switches `a·k/2 .. (a+1)·k/2`.
#[derive(Debug, Clone)]
pub struct FatTree {
    /// The arity.
    pub k: usize,
    /// Hosts, pod by pod, edge by edge: host `i` of edge `e` of pod `p` is
    /// `hosts[(p * k/2 + e) * k/2 + i]`.
    pub hosts: Vec<HostId>,
    /// `edges[pod][e]`.
    pub edges: Vec<Vec<SwitchId>>,
    /// `aggs[pod][a]`.
    pub aggs: Vec<Vec<SwitchId>>,
    /// Core switches; core `c` is reached from aggregation switch `c / (k/2)` of each pod.
    pub cores: Vec<SwitchId>,
    /// Per host: `forward` is host → edge.
    pub host_links: Vec<LinkPair>,
    /// `edge_agg[pod][e][a]`: `forward` is edge → aggregation.
    pub edge_agg: Vec<Vec<Vec<LinkPair>>>,
    /// `agg_core[pod][a][j]`: `forward` is aggregation `a` → core `a·k/2 + j`.
    pub agg_core: Vec<Vec<Vec<LinkPair>>>,
}

/// The shape of each plane of a [`MultiPlane`] fabric.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlaneShape {
    /// One switch per plane, every host attached to it.
    SingleSwitch,
    /// A leaf-spine per plane; the hosts are spread over the leaves in contiguous blocks of
    /// `ceil(hosts / leaves)`.
    LeafSpine {
        /// Leaves per plane.
        leaves: usize,
        /// Spines per plane.
        spines: usize,
    },
}

/// One plane of a [`MultiPlane`] fabric.
#[derive(Debug, Clone)]
pub struct Plane {
    /// Switches the hosts attach to (one for [`PlaneShape::SingleSwitch`]).
    pub leaves: Vec<SwitchId>,
    /// Spine switches (none for a single-switch plane).
    pub spines: Vec<SwitchId>,
    /// Per host (order of [`MultiPlane::hosts`]): `forward` is host → this plane.
    pub host_links: Vec<LinkPair>,
    /// `fabric_links[leaf][spine]`: `forward` is leaf → spine.
    pub fabric_links: Vec<Vec<LinkPair>>,
}

impl Plane {
    /// Every link direction of the plane (to fail the whole plane).
    pub fn all_links(&self) -> Vec<LinkId> {
        self.host_links
            .iter()
            .chain(self.fabric_links.iter().flatten())
            .flat_map(|p| p.both())
            .collect()
    }
}

/// `P` independent planes made by [`Sim::multi_plane`]; every host has one uplink per
/// plane (uplink `p` of a host goes to plane `p`) and picks among them per packet by
/// [`SimConfig::uplink_policy`](super::SimConfig::uplink_policy).
#[derive(Debug, Clone)]
pub struct MultiPlane {
    /// The hosts.
    pub hosts: Vec<HostId>,
    /// The planes.
    pub planes: Vec<Plane>,
}

impl Sim {
    /// Add a leaf-spine: `leaves × hosts_per_leaf` hosts, each on a `host_link` to its
    /// leaf, and a `fabric_link` between every leaf and every spine.
    ///
    /// # Panics
    /// If `leaves` is 0.
    pub fn leaf_spine(
        &mut self,
        leaves: usize,
        spines: usize,
        hosts_per_leaf: usize,
        host_link: LinkConfig,
        fabric_link: LinkConfig,
    ) -> LeafSpine {
        assert!(leaves > 0, "a leaf-spine needs at least one leaf");
        let leaf_ids: Vec<SwitchId> = (0..leaves).map(|_| self.add_switch()).collect();
        let spine_ids: Vec<SwitchId> = (0..spines).map(|_| self.add_switch()).collect();
        let mut hosts = Vec::with_capacity(leaves * hosts_per_leaf);
        let mut host_links = Vec::with_capacity(leaves * hosts_per_leaf);
        for &leaf in &leaf_ids {
            for _ in 0..hosts_per_leaf {
                let h = self.add_host();
                host_links.push(self.connect(h, leaf, host_link.clone()));
                hosts.push(h);
            }
        }
        let fabric_links = leaf_ids
            .iter()
            .map(|&leaf| {
                spine_ids
                    .iter()
                    .map(|&spine| self.connect(leaf, spine, fabric_link.clone()))
                    .collect()
            })
            .collect();
        LeafSpine {
            hosts,
            leaves: leaf_ids,
            spines: spine_ids,
            host_links,
            fabric_links,
        }
    }

    /// Add a k-ary fat tree (`k³/4` hosts): hosts on `host_link`s, every switch-to-switch
    /// link a `fabric_link`.
    ///
    /// # Panics
    /// If `k` is odd or 0.
    pub fn fat_tree(
        &mut self,
        k: usize,
        host_link: LinkConfig,
        fabric_link: LinkConfig,
    ) -> FatTree {
        assert!(
            k >= 2 && k % 2 == 0,
            "fat_tree needs an even k >= 2, got {k}"
        );
        let half = k / 2;
        let cores: Vec<SwitchId> = (0..half * half).map(|_| self.add_switch()).collect();
        let mut t = FatTree {
            k,
            hosts: Vec::new(),
            edges: Vec::new(),
            aggs: Vec::new(),
            cores,
            host_links: Vec::new(),
            edge_agg: Vec::new(),
            agg_core: Vec::new(),
        };
        for _pod in 0..k {
            let edges: Vec<SwitchId> = (0..half).map(|_| self.add_switch()).collect();
            let aggs: Vec<SwitchId> = (0..half).map(|_| self.add_switch()).collect();
            for &edge in &edges {
                for _ in 0..half {
                    let h = self.add_host();
                    t.host_links.push(self.connect(h, edge, host_link.clone()));
                    t.hosts.push(h);
                }
            }
            let edge_agg = edges
                .iter()
                .map(|&e| {
                    aggs.iter()
                        .map(|&a| self.connect(e, a, fabric_link.clone()))
                        .collect()
                })
                .collect();
            let agg_core = aggs
                .iter()
                .enumerate()
                .map(|(i, &a)| {
                    (0..half)
                        .map(|j| self.connect(a, t.cores[i * half + j], fabric_link.clone()))
                        .collect()
                })
                .collect();
            t.edges.push(edges);
            t.aggs.push(aggs);
            t.edge_agg.push(edge_agg);
            t.agg_core.push(agg_core);
        }
        t
    }

    /// Add `planes` independent planes of the given shape and `hosts` hosts, each with one
    /// `host_link` uplink per plane; switch-to-switch links are `fabric_link`s.
    ///
    /// # Panics
    /// If `planes` is 0, or a leaf-spine plane has no leaves.
    pub fn multi_plane(
        &mut self,
        planes: usize,
        hosts: usize,
        shape: PlaneShape,
        host_link: LinkConfig,
        fabric_link: LinkConfig,
    ) -> MultiPlane {
        assert!(planes > 0, "multi_plane needs at least one plane");
        let host_ids: Vec<HostId> = (0..hosts).map(|_| self.add_host()).collect();
        let (leaves, spines) = match shape {
            PlaneShape::SingleSwitch => (1, 0),
            PlaneShape::LeafSpine { leaves, spines } => (leaves, spines),
        };
        assert!(leaves > 0, "a leaf-spine plane needs at least one leaf");
        let per_leaf = hosts.div_ceil(leaves).max(1);
        let planes = (0..planes)
            .map(|_| {
                let leaf_ids: Vec<SwitchId> = (0..leaves).map(|_| self.add_switch()).collect();
                let spine_ids: Vec<SwitchId> = (0..spines).map(|_| self.add_switch()).collect();
                let host_links = host_ids
                    .iter()
                    .enumerate()
                    .map(|(i, &h)| self.connect(h, leaf_ids[i / per_leaf], host_link.clone()))
                    .collect();
                let fabric_links = leaf_ids
                    .iter()
                    .map(|&leaf| {
                        spine_ids
                            .iter()
                            .map(|&spine| self.connect(leaf, spine, fabric_link.clone()))
                            .collect()
                    })
                    .collect();
                Plane {
                    leaves: leaf_ids,
                    spines: spine_ids,
                    host_links,
                    fabric_links,
                }
            })
            .collect();
        MultiPlane {
            hosts: host_ids,
            planes,
        }
    }
}
