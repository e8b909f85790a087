//! The out-of-band exchange that precedes connecting an RC QP, in the manner of
//! `ibv_rc_pingpong`'s TCP exchange (port 18515): each side sends its QPN, initial PSN
//! and GID, plus here the UDP port its packets go to and optionally one memory region.

use super::ConnectAttrs;
use crate::RemoteRegion;
use std::io;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// One side's connection parameters of an RC QP.
///
/// On the wire: exactly [`QpExchange::LEN`] ASCII bytes,
/// `QPN:PSN:GID:PORT:ADDR:RKEY:LEN\n` in fixed-width lowercase hex (6, 6, 32, 4, 16, 8,
/// 16 digits). The GID is the IPv6 form of the IP (`::ffff:a.b.c.d` for IPv4, as
/// rdma_rxe's RoCEv2 GIDs are); `LEN` 0 means no region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpExchange {
    /// QPN (24 bits).
    pub qpn: u32,
    /// Initial send PSN (24 bits): the peer's expected receive PSN.
    pub psn: u32,
    /// The IP address (GID) the QP's packets come from.
    pub ip: IpAddr,
    /// UDP port packets for this QP go to: 4791 for native RoCEv2, the endpoint's port
    /// for a QP of a [`crate::Endpoint`].
    pub udp_port: u16,
    /// A region the peer may access (address, rkey, length in bytes), if any.
    pub region: Option<RemoteRegion>,
}

impl QpExchange {
    /// Bytes of one record on the wire.
    pub const LEN: usize = 6 + 1 + 6 + 1 + 32 + 1 + 4 + 1 + 16 + 1 + 8 + 1 + 16 + 1;

    /// The record as sent.
    pub fn to_record(&self) -> String {
        let gid = match self.ip {
            IpAddr::V4(v4) => v4.to_ipv6_mapped(),
            IpAddr::V6(v6) => v6,
        };
        let r = self.region.unwrap_or(RemoteRegion {
            addr: 0,
            len: 0,
            rkey: 0,
        });
        format!(
            "{:06x}:{:06x}:{:032x}:{:04x}:{:016x}:{:08x}:{:016x}\n",
            self.qpn & 0xFF_FFFF,
            self.psn & 0xFF_FFFF,
            u128::from(gid),
            self.udp_port,
            r.addr,
            r.rkey,
            r.len
        )
    }

    /// Parse one record. Errors (`InvalidData`) on any deviation from the format.
    pub fn parse(rec: &[u8]) -> io::Result<QpExchange> {
        let bad =
            |what: &str| io::Error::new(io::ErrorKind::InvalidData, format!("QP record: {what}"));
        if rec.len() != Self::LEN || rec[Self::LEN - 1] != b'\n' {
            return Err(bad("wrong length or no newline"));
        }
        let s = std::str::from_utf8(&rec[..Self::LEN - 1]).map_err(|_| bad("not ASCII"))?;
        let f: Vec<&str> = s.split(':').collect();
        let widths = [6, 6, 32, 4, 16, 8, 16];
        if f.len() != widths.len()
            || f.iter().zip(widths).any(|(x, w)| {
                x.len() != w
                    || !x
                        .bytes()
                        .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
            })
        {
            return Err(bad("malformed field"));
        }
        let hex = |x: &str| u128::from_str_radix(x, 16).map_err(|_| bad("bad hex"));
        let gid = Ipv6Addr::from(hex(f[2])?);
        let ip = gid.to_ipv4_mapped().map_or(IpAddr::V6(gid), IpAddr::V4);
        let len = hex(f[6])? as u64;
        Ok(QpExchange {
            qpn: hex(f[0])? as u32,
            psn: hex(f[1])? as u32,
            ip,
            udp_port: hex(f[3])? as u16,
            region: (len > 0).then(|| RemoteRegion {
                addr: hex(f[4]).unwrap_or(0) as u64,
                rkey: hex(f[5]).unwrap_or(0) as u32,
                len,
            }),
        })
    }

    /// Connect attributes towards this side with the `ibv_rc_pingpong` defaults
    /// ([`ConnectAttrs::new`]); adjust fields (MTU, timeout, READ/atomic depth) as needed.
    pub fn connect_attrs(&self) -> ConnectAttrs {
        ConnectAttrs::new(self.ip, self.qpn, self.psn)
    }

    /// The UDP address packets for this side go to.
    pub fn udp_addr(&self) -> SocketAddr {
        SocketAddr::new(self.ip, self.udp_port)
    }
}

/// Send `local`'s record on `stream` and read the peer's (both sides call this, in any
/// order; e.g. over a `TcpStream` one side accepted and the other connected). Reads exactly
/// [`QpExchange::LEN`] bytes.
///
/// # Errors
/// I/O errors, or `InvalidData` for a malformed record.
///
/// # Cancel safety
/// Not cancel safe: dropping it part-way leaves a partial record on `stream`; drop the
/// stream too.
pub async fn exchange<S>(stream: &mut S, local: &QpExchange) -> io::Result<QpExchange>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    stream.write_all(local.to_record().as_bytes()).await?;
    stream.flush().await?;
    let mut rec = [0u8; QpExchange::LEN];
    stream.read_exact(&mut rec).await?;
    QpExchange::parse(&rec)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_round_trips_and_rejects_garbage() {
        let a = QpExchange {
            qpn: 0x12_3456,
            psn: 0xAB_CDEF,
            ip: "10.1.2.3".parse().unwrap(),
            udp_port: 50123,
            region: Some(RemoteRegion {
                addr: 0xDEAD_BEEF_0000,
                rkey: 0x1234_5678,
                len: 1 << 20,
            }),
        };
        let r = a.to_record();
        assert_eq!(r.len(), QpExchange::LEN);
        assert!(r.starts_with("123456:abcdef:00000000000000000000ffff0a010203:c3cb:"));
        assert_eq!(QpExchange::parse(r.as_bytes()).unwrap(), a);
        let v6 = QpExchange {
            ip: "fd00::7".parse().unwrap(),
            region: None,
            ..a
        };
        assert_eq!(QpExchange::parse(v6.to_record().as_bytes()).unwrap(), v6);
        let mut bad = r.clone().into_bytes();
        bad[3] = b'G';
        assert!(QpExchange::parse(&bad).is_err());
        assert!(QpExchange::parse(&r.as_bytes()[..QpExchange::LEN - 1]).is_err());
    }
}
