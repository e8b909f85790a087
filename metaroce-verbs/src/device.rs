//! Devices, ports and the GID table.

use crate::{ffi, verbs_err, Error, Pd, Result};
use std::net::{IpAddr, Ipv6Addr};
use std::sync::Arc;

/// Names of the RDMA devices present (`ibv_get_device_list`), e.g. `["rxe0"]`.
///
/// # Errors
/// [`Error::LibraryNotFound`] without libibverbs.
pub fn devices() -> Result<Vec<String>> {
    ffi::device_names().map_err(Error::LibraryNotFound)
}

pub(crate) struct CtxInner {
    pub(crate) raw: ffi::Raw,
    name: String,
}

impl Drop for CtxInner {
    fn drop(&mut self) {
        // SAFETY: CtxInner owns the context and drops once; every object made from it
        // holds an Arc of this CtxInner, so all are gone.
        unsafe { ffi::close_device(self.raw) };
    }
}

/// An open RDMA device (`ibv_context`). Cheap to clone (shared); closed when the last
/// clone and every object made from it are gone.
#[derive(Clone)]
pub struct Context(pub(crate) Arc<CtxInner>);

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("name", &self.0.name)
            .finish()
    }
}

/// What `ibv_query_port` says about a port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortAttr {
    /// `ibv_port_state` (4 = ACTIVE).
    pub state: u32,
    /// Largest path MTU the port supports, in bytes.
    pub max_mtu: u32,
    /// Active path MTU, in bytes.
    pub active_mtu: u32,
    /// Entries in the GID table.
    pub gid_tbl_len: u32,
    /// `IBV_LINK_LAYER_*`: 1 InfiniBand, 2 Ethernet (RoCE).
    pub link_layer: u8,
}

/// Kind of a GID table entry (from sysfs `gid_attrs/types/N`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GidType {
    /// "RoCE v2": packets in UDP (port 4791) over IP.
    RoceV2,
    /// "IB/RoCE v1": InfiniBand or RoCE v1 (Ethernet, no IP).
    IbRoceV1,
    /// sysfs did not say.
    Unknown,
}

/// One entry of a port's GID table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GidEntry {
    /// Index in the table (`-x`/`-g` of perftest / `ibv_rc_pingpong`).
    pub index: u8,
    /// The GID.
    pub gid: Ipv6Addr,
    /// Its type.
    pub kind: GidType,
}

impl GidEntry {
    /// The IP address of a RoCEv2 GID (IPv4 for `::ffff:a.b.c.d`).
    pub fn ip(&self) -> IpAddr {
        self.gid
            .to_ipv4_mapped()
            .map_or(IpAddr::V6(self.gid), IpAddr::V4)
    }
}

fn mtu_bytes(e: u32) -> u32 {
    match e {
        1..=5 => 128 << e,
        _ => 0,
    }
}

impl Context {
    /// Open the device called `name`, or the first device if `None`.
    ///
    /// # Errors
    /// [`Error::LibraryNotFound`] without libibverbs, [`Error::NoDevice`] without such a
    /// device, [`Error::Verbs`] if `ibv_open_device` fails.
    pub fn open(name: Option<&str>) -> Result<Context> {
        let names = devices()?;
        let pick = match name {
            Some(n) => names.iter().find(|d| *d == n),
            None => names.first(),
        }
        .cloned()
        .ok_or_else(|| Error::NoDevice(name.map(str::to_owned)))?;
        let raw = ffi::open_device(&pick)
            .map_err(|e| Error::Verbs {
                op: "ibv_open_device",
                source: std::io::Error::other(e),
            })?
            .ok_or_else(|| Error::NoDevice(Some(pick.clone())))?;
        Ok(Context(Arc::new(CtxInner { raw, name: pick })))
    }

    /// The device name (`rxe0`, `mlx5_0`, ...).
    pub fn name(&self) -> &str {
        &self.0.name
    }

    /// `ibv_query_port` on `port` (1-based).
    pub fn query_port(&self, port: u8) -> Result<PortAttr> {
        let a = ffi::query_port(self.0.raw, port).map_err(verbs_err("ibv_query_port"))?;
        Ok(PortAttr {
            state: a.state,
            max_mtu: mtu_bytes(a.max_mtu),
            active_mtu: mtu_bytes(a.active_mtu),
            gid_tbl_len: a.gid_tbl_len.max(0) as u32,
            link_layer: a.link_layer,
        })
    }

    /// The GID at `index` of `port` (`ibv_query_gid`).
    pub fn gid(&self, port: u8, index: u8) -> Result<Ipv6Addr> {
        let g = ffi::query_gid(self.0.raw, port, i32::from(index))
            .map_err(verbs_err("ibv_query_gid"))?;
        Ok(Ipv6Addr::from(g))
    }

    /// The non-zero entries of `port`'s GID table, with their types read from
    /// `/sys/class/infiniband/DEV/ports/PORT/gid_attrs/types/N` (as rdma-core's
    /// `ibv_query_gid_type` and perftest do).
    pub fn gid_table(&self, port: u8) -> Result<Vec<GidEntry>> {
        let len = self.query_port(port)?.gid_tbl_len.min(256);
        let mut out = Vec::new();
        for i in 0..len {
            let index = i as u8;
            let Ok(gid) = self.gid(port, index) else {
                continue;
            };
            if gid.is_unspecified() {
                continue;
            }
            let path = format!(
                "/sys/class/infiniband/{}/ports/{port}/gid_attrs/types/{i}",
                self.0.name
            );
            let kind = match std::fs::read_to_string(path) {
                Ok(s) if s.trim().eq_ignore_ascii_case("RoCE v2") => GidType::RoceV2,
                Ok(s) if s.trim().eq_ignore_ascii_case("IB/RoCE v1") => GidType::IbRoceV1,
                _ => GidType::Unknown,
            };
            out.push(GidEntry { index, gid, kind });
        }
        Ok(out)
    }

    /// The first RoCEv2 GID of `port` whose address is IPv4 (`ipv4` true,
    /// `::ffff:a.b.c.d`) or IPv6 (false, not link-local-only if a global one exists).
    ///
    /// # Errors
    /// [`Error::NoGid`] if there is none.
    pub fn select_gid(&self, port: u8, ipv4: bool) -> Result<GidEntry> {
        let t = self.gid_table(port)?;
        let v2 = |e: &&GidEntry| e.kind == GidType::RoceV2;
        let found = if ipv4 {
            t.iter()
                .filter(v2)
                .find(|e| e.gid.to_ipv4_mapped().is_some())
        } else {
            let v6: Vec<&GidEntry> = t
                .iter()
                .filter(v2)
                .filter(|e| e.gid.to_ipv4_mapped().is_none())
                .collect();
            v6.iter()
                .find(|e| (e.gid.segments()[0] & 0xffc0) != 0xfe80)
                .or(v6.first())
                .copied()
        };
        found.copied().ok_or(Error::NoGid(if ipv4 {
            "RoCEv2 IPv4"
        } else {
            "RoCEv2 IPv6"
        }))
    }

    /// Allocate a protection domain.
    pub fn alloc_pd(&self) -> Result<Pd> {
        Pd::new(self)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn mtu_enum_to_bytes() {
        assert_eq!(super::mtu_bytes(1), 256);
        assert_eq!(super::mtu_bytes(5), 4096);
        assert_eq!(super::mtu_bytes(0), 0);
        assert_eq!(super::mtu_bytes(9), 0);
    }
}
