//! The in-band control exchange between the client and the server of a run (perftest's
//! "out-of-band" exchange of QPNs and rkeys, carried here on a message stream of the
//! connection itself).
//!
//! Every control message is one stream message:
//!
//! ```text
//! offset 0  4 bytes  magic "MRPF"
//! offset 4  1 byte   version (1)
//! offset 5  1 byte   kind
//! offset 6  ...      fields of the kind, big-endian, in this order:
//!
//! 1 HELLO    client -> server  test u8 (1 write_bw, 2 send_lat), rounds u32, client QPN u32
//! 2 WELCOME  server -> client  server QPN u32
//! 3 SETUP    client -> server  size u64, iters u64 (0: timed run), region_len u64
//! 4 READY    server -> client  RemoteRegion::to_bytes() (20 bytes: addr u64, len u64,
//!                              rkey u32; all zero for send_lat), size u64, iters u64,
//!                              slots u64
//! 5 DONE     client -> server  check_len u64 (destination prefix to checksum), ops u64
//! 6 RESULT   server -> client  crc32 u32 of destination[0..check_len], check_len u64,
//!                              ops u64 (send_lat: messages echoed so far)
//! 7 BYE      client -> server  (no fields)
//! 8 ERROR    server -> client  UTF-8 text
//! ```
//!
//! A run is HELLO/WELCOME, then per size SETUP/READY, the measurement, DONE/RESULT, and
//! finally BYE. send_lat ping-pongs on a second stream the client opens; the server echoes
//! every message of every stream other than the control stream.

use metaroce_tokio::RemoteRegion;

const MAGIC: &[u8; 4] = b"MRPF";
const VERSION: u8 = 1;

/// One control message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ctrl {
    /// Client greeting.
    Hello {
        /// Test code (see [`crate::perf::cli::Test::code`]).
        test: u8,
        /// Sizes to run.
        rounds: u32,
        /// Client's QPN.
        qpn: u32,
    },
    /// Server greeting.
    Welcome {
        /// Server's QPN.
        qpn: u32,
    },
    /// Parameters of one size.
    Setup {
        /// Bytes per WRITE / message.
        size: u64,
        /// Iterations, 0 for a timed run.
        iters: u64,
        /// Destination region to allocate (write_bw), 0 for send_lat.
        region_len: u64,
    },
    /// The destination is ready.
    Ready {
        /// Destination region.
        region: RemoteRegion,
        /// Echo of the size.
        size: u64,
        /// Echo of the iterations.
        iters: u64,
        /// Slots of `size` bytes in the region.
        slots: u64,
    },
    /// The measurement is over.
    Done {
        /// Prefix of the destination to checksum.
        check_len: u64,
        /// Operations completed.
        ops: u64,
    },
    /// The server's view.
    Result {
        /// CRC-32 of the destination prefix.
        crc: u32,
        /// Length checksummed.
        check_len: u64,
        /// Messages echoed (send_lat).
        ops: u64,
    },
    /// End of the run.
    Bye,
    /// The server refused something.
    Error(String),
}

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> Option<[u8; N]> {
        let (head, rest) = self.0.split_at_checked(N)?;
        self.0 = rest;
        head.try_into().ok()
    }
    fn u8(&mut self) -> Option<u8> {
        self.take::<1>().map(|b| b[0])
    }
    fn u32(&mut self) -> Option<u32> {
        self.take().map(u32::from_be_bytes)
    }
    fn u64(&mut self) -> Option<u64> {
        self.take().map(u64::from_be_bytes)
    }
}

impl Ctrl {
    fn kind(&self) -> u8 {
        match self {
            Ctrl::Hello { .. } => 1,
            Ctrl::Welcome { .. } => 2,
            Ctrl::Setup { .. } => 3,
            Ctrl::Ready { .. } => 4,
            Ctrl::Done { .. } => 5,
            Ctrl::Result { .. } => 6,
            Ctrl::Bye => 7,
            Ctrl::Error(_) => 8,
        }
    }

    /// Encodes the message.
    pub fn encode(&self) -> bytes::Bytes {
        let mut b = Vec::with_capacity(64);
        b.extend_from_slice(MAGIC);
        b.push(VERSION);
        b.push(self.kind());
        match self {
            Ctrl::Hello { test, rounds, qpn } => {
                b.push(*test);
                b.extend_from_slice(&rounds.to_be_bytes());
                b.extend_from_slice(&qpn.to_be_bytes());
            }
            Ctrl::Welcome { qpn } => b.extend_from_slice(&qpn.to_be_bytes()),
            Ctrl::Setup {
                size,
                iters,
                region_len,
            } => {
                for v in [size, iters, region_len] {
                    b.extend_from_slice(&v.to_be_bytes());
                }
            }
            Ctrl::Ready {
                region,
                size,
                iters,
                slots,
            } => {
                b.extend_from_slice(&region.to_bytes());
                for v in [size, iters, slots] {
                    b.extend_from_slice(&v.to_be_bytes());
                }
            }
            Ctrl::Done { check_len, ops } => {
                b.extend_from_slice(&check_len.to_be_bytes());
                b.extend_from_slice(&ops.to_be_bytes());
            }
            Ctrl::Result {
                crc,
                check_len,
                ops,
            } => {
                b.extend_from_slice(&crc.to_be_bytes());
                b.extend_from_slice(&check_len.to_be_bytes());
                b.extend_from_slice(&ops.to_be_bytes());
            }
            Ctrl::Bye => {}
            Ctrl::Error(text) => b.extend_from_slice(text.as_bytes()),
        }
        b.into()
    }

    /// Decodes a message; `None` if it is not a well-formed control message.
    pub fn decode(msg: &[u8]) -> Option<Ctrl> {
        let mut r = Reader(msg);
        if &r.take::<4>()? != MAGIC || r.u8()? != VERSION {
            return None;
        }
        let kind = r.u8()?;
        let m = match kind {
            1 => Ctrl::Hello {
                test: r.u8()?,
                rounds: r.u32()?,
                qpn: r.u32()?,
            },
            2 => Ctrl::Welcome { qpn: r.u32()? },
            3 => Ctrl::Setup {
                size: r.u64()?,
                iters: r.u64()?,
                region_len: r.u64()?,
            },
            4 => Ctrl::Ready {
                region: RemoteRegion::from_bytes(&r.take::<{ RemoteRegion::ENCODED_LEN }>()?)?,
                size: r.u64()?,
                iters: r.u64()?,
                slots: r.u64()?,
            },
            5 => Ctrl::Done {
                check_len: r.u64()?,
                ops: r.u64()?,
            },
            6 => Ctrl::Result {
                crc: r.u32()?,
                check_len: r.u64()?,
                ops: r.u64()?,
            },
            7 => Ctrl::Bye,
            8 => {
                let text = String::from_utf8_lossy(r.0).into_owned();
                r.0 = &[];
                Ctrl::Error(text)
            }
            _ => return None,
        };
        r.0.is_empty().then_some(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let region = RemoteRegion {
            addr: 0x1000,
            len: 4096,
            rkey: 7,
        };
        for m in [
            Ctrl::Hello {
                test: 1,
                rounds: 23,
                qpn: 0x12,
            },
            Ctrl::Welcome { qpn: 5 },
            Ctrl::Setup {
                size: 65536,
                iters: 5000,
                region_len: 1 << 30,
            },
            Ctrl::Ready {
                region,
                size: 1,
                iters: 2,
                slots: 3,
            },
            Ctrl::Done {
                check_len: 9,
                ops: 10,
            },
            Ctrl::Result {
                crc: 0xdead_beef,
                check_len: 9,
                ops: 1,
            },
            Ctrl::Bye,
            Ctrl::Error("no".into()),
        ] {
            assert_eq!(Ctrl::decode(&m.encode()), Some(m));
        }
        assert_eq!(Ctrl::decode(b"MRPF\x01\x07x"), None);
        assert_eq!(Ctrl::decode(b"hello"), None);
    }
}
