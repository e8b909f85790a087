//! Connection setup with `ibv_rc_pingpong`'s out-of-band TCP exchange (default port
//! 18515): `"%04x:%06x:%06x:%s"` = LID:QPN:PSN:GID, the GID as 32 hex digits in wire
//! order, 52 bytes including the NUL. The client connects, writes its record, reads the
//! server's, connects its QP and writes `"done"`; the server reads the client's record,
//! connects its QP (to RTR and RTS, so it is ready before the client sends), writes its own
//! and waits for `"done"`. A metaroce peer and the stock tool interoperate in both roles.

use crate::{Error, QpEndpoint, RcQp, Result};
use std::io;
use std::net::Ipv6Addr;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Bytes of one record on the wire.
pub const RECORD_LEN: usize = 52;

/// `ibv_rc_pingpong`'s record for `e`.
pub fn to_record(e: &QpEndpoint) -> [u8; RECORD_LEN] {
    let gid: String = e.gid.octets().iter().map(|b| format!("{b:02x}")).collect();
    let s = format!(
        "{:04x}:{:06x}:{:06x}:{}",
        e.lid,
        e.qpn & 0xFF_FFFF,
        e.psn & 0xFF_FFFF,
        gid
    );
    let mut out = [0u8; RECORD_LEN];
    out[..s.len()].copy_from_slice(s.as_bytes());
    out
}

fn bad(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

/// Parse a peer's record (the 52 bytes; trailing NULs allowed, extra `:`-fields ignored).
///
/// # Errors
/// `InvalidData` on any malformed field.
pub fn parse_record(rec: &[u8]) -> io::Result<QpEndpoint> {
    let end = rec.iter().position(|&b| b == 0).unwrap_or(rec.len());
    let s = std::str::from_utf8(&rec[..end]).map_err(|_| bad("record not ASCII"))?;
    let f: Vec<&str> = s.split(':').collect();
    if f.len() < 4 || f[0].len() != 4 || f[1].len() != 6 || f[2].len() != 6 || f[3].len() != 32 {
        return Err(bad(format!("malformed record {s:?}")));
    }
    let hex = |x: &str| u32::from_str_radix(x, 16).map_err(|_| bad(format!("bad hex {x:?}")));
    let g = u128::from_str_radix(f[3], 16).map_err(|_| bad("bad GID hex"))?;
    Ok(QpEndpoint {
        lid: hex(f[0])? as u16,
        qpn: hex(f[1])?,
        psn: hex(f[2])?,
        gid: Ipv6Addr::from(g),
    })
}

/// Client side: exchange over `tcp` (already connected to the server), then connect `qp`.
/// Returns the server's address.
///
/// # Errors
/// [`Error::Exchange`] on I/O or a malformed record, or the error of [`RcQp::connect`].
///
/// # Cancel safety
/// Not cancel safe (drop the TCP stream too).
pub async fn client<S: AsyncRead + AsyncWrite + Unpin>(
    tcp: &mut S,
    qp: &RcQp,
) -> Result<QpEndpoint> {
    tcp.write_all(&to_record(&qp.local()))
        .await
        .map_err(Error::Exchange)?;
    let mut rec = [0u8; RECORD_LEN];
    tcp.read_exact(&mut rec).await.map_err(Error::Exchange)?;
    let remote = parse_record(&rec).map_err(Error::Exchange)?;
    qp.connect(&remote)?;
    tcp.write_all(b"done\0").await.map_err(Error::Exchange)?;
    tcp.flush().await.map_err(Error::Exchange)?;
    Ok(remote)
}

/// Server side: exchange over `tcp` (an accepted connection), connecting `qp` before
/// answering. Returns the client's address.
///
/// # Errors
/// As [`client`].
pub async fn server<S: AsyncRead + AsyncWrite + Unpin>(
    tcp: &mut S,
    qp: &RcQp,
) -> Result<QpEndpoint> {
    let mut rec = [0u8; RECORD_LEN];
    tcp.read_exact(&mut rec).await.map_err(Error::Exchange)?;
    let remote = parse_record(&rec).map_err(Error::Exchange)?;
    qp.connect(&remote)?;
    tcp.write_all(&to_record(&qp.local()))
        .await
        .map_err(Error::Exchange)?;
    tcp.flush().await.map_err(Error::Exchange)?;
    let mut done = [0u8; 5];
    // ibv_rc_pingpong's client writes "done" after connecting; a short read is fine.
    let _ = tcp.read(&mut done).await.map_err(Error::Exchange)?;
    Ok(remote)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_matches_ibv_rc_pingpong_and_round_trips() {
        let e = QpEndpoint {
            lid: 0,
            qpn: 0x11,
            psn: 0xabcdef,
            gid: "::ffff:10.77.0.2".parse().unwrap(),
        };
        let r = to_record(&e);
        assert_eq!(
            &r[..51],
            b"0000:000011:abcdef:00000000000000000000ffff0a4d0002"
        );
        assert_eq!(r[51], 0);
        assert_eq!(parse_record(&r).unwrap(), e);
        let mut b = r;
        b[10] = b'x';
        assert!(parse_record(&b).is_err());
        assert!(parse_record(b"0000:11:22:33").is_err());
        assert!(parse_record(&[0xff; 52]).is_err());
    }
}
