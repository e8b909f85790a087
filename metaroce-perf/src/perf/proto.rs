//! The control exchange between the client and the server of a run (perftest's
//! "out-of-band" exchange of QPNs, PSNs, addresses and rkeys).
//!
//! In `--mode metaroce` it is carried in-band, on the first message stream of the
//! connection. In `--mode rocev2` the RC queue pair cannot carry it before it is connected,
//! so it runs over a TCP connection (the server listens on `--oob-port`, default 18515, like
//! perftest's exchange), each message framed by a 4-byte big-endian length; in loopback the
//! two halves talk over an in-process pipe with the same framing.
//!
//! Every control message:
//!
//! ```text
//! offset 0  4 bytes  magic "MRPF"
//! offset 4  1 byte   version (2)
//! offset 5  1 byte   kind
//! offset 6  ...      fields of the kind, big-endian, in this order:
//!
//! 1 HELLO    client -> server  test u8 (Test::code), rounds u32, max_size u64,
//!                              QPN u32, PSN u32 (rocev2; 0 otherwise),
//!                              UDP port u16 (rocev2: where the client's RC datagrams
//!                              are received; 0 otherwise)
//! 2 WELCOME  server -> client  QPN u32, PSN u32, UDP port u16 (as HELLO)
//! 3 SETUP    client -> server  size u64, iters u64 (0: timed run), region_len u64,
//!                              data seed u64, client region (RemoteRegion::to_bytes(),
//!                              20 bytes: addr u64, len u64, rkey u32; write_lat's reply
//!                              target, all zero otherwise)
//! 4 READY    server -> client  server region (20 bytes, all zero when none), size u64,
//!                              iters u64, slots u64
//! 5 DONE     client -> server  check_len u64 (prefix to checksum), ops u64
//! 6 RESULT   server -> client  crc32 u32, check_len u64, ops u64, value u64
//! 7 BYE      client -> server  (no fields)
//! 8 ERROR    server -> client  UTF-8 text
//! ```
//!
//! A run is HELLO/WELCOME, then per size SETUP/READY, the measurement, DONE/RESULT, and
//! finally BYE. What RESULT means depends on the test:
//!
//! | test       | server region            | crc / check_len                      | ops               | value            |
//! |------------|--------------------------|--------------------------------------|-------------------|------------------|
//! | write_bw   | WRITE destination        | CRC-32 of destination[..check_len]   | -                 | -                |
//! | read_bw    | READ source (seeded)     | CRC-32 of source[..check_len]        | -                 | -                |
//! | read_lat   | READ source (seeded)     | -                                    | -                 | -                |
//! | write_lat  | WRITE-with-imm target    | -                                    | replies sent      | landed mismatches|
//! | atomic_lat | 8-byte counter (seeded)  | -                                    | -                 | final counter    |
//! | send_bw    | none                     | CRC-32 of every byte received        | messages received | bytes received   |
//! | send_lat   | none                     | -                                    | messages echoed   | -                |

use metaroce_tokio::RemoteRegion;

const MAGIC: &[u8; 4] = b"MRPF";
const VERSION: u8 = 2;

/// Largest framed control message accepted on the TCP channel.
pub const MAX_FRAME: usize = 1 << 16;

/// An all-zero region descriptor ("none").
pub const NO_REGION: RemoteRegion = RemoteRegion {
    addr: 0,
    len: 0,
    rkey: 0,
};

/// One control message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ctrl {
    /// Client greeting.
    Hello {
        /// Test code (see [`crate::perf::cli::Test::code`]).
        test: u8,
        /// Sizes to run.
        rounds: u32,
        /// Largest size of the run (receive buffers of the RC send tests).
        max_size: u64,
        /// Client's QPN.
        qpn: u32,
        /// Client's initial PSN (rocev2).
        psn: u32,
        /// Client's UDP port (rocev2).
        port: u16,
    },
    /// Server greeting.
    Welcome {
        /// Server's QPN.
        qpn: u32,
        /// Server's initial PSN (rocev2).
        psn: u32,
        /// Server's UDP port (rocev2).
        port: u16,
    },
    /// Parameters of one size.
    Setup {
        /// Bytes per operation / message.
        size: u64,
        /// Iterations, 0 for a timed run.
        iters: u64,
        /// Server region to allocate, 0 for none.
        region_len: u64,
        /// Seed of the data of this round.
        seed: u64,
        /// The client's region (write_lat).
        peer: RemoteRegion,
    },
    /// The server is ready.
    Ready {
        /// Server region.
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
        /// Prefix to checksum.
        check_len: u64,
        /// Operations completed.
        ops: u64,
    },
    /// The server's view.
    Result {
        /// CRC-32.
        crc: u32,
        /// Length checksummed.
        check_len: u64,
        /// Operation count (see the module table).
        ops: u64,
        /// Test-specific value (see the module table).
        value: u64,
    },
    /// End of the run.
    Bye,
    /// The server refused something, or a task serving the client failed: the run ends.
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
    fn u16(&mut self) -> Option<u16> {
        self.take().map(u16::from_be_bytes)
    }
    fn u32(&mut self) -> Option<u32> {
        self.take().map(u32::from_be_bytes)
    }
    fn u64(&mut self) -> Option<u64> {
        self.take().map(u64::from_be_bytes)
    }
    fn region(&mut self) -> Option<RemoteRegion> {
        RemoteRegion::from_bytes(&self.take::<{ RemoteRegion::ENCODED_LEN }>()?)
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
        let mut b = Vec::with_capacity(80);
        b.extend_from_slice(MAGIC);
        b.push(VERSION);
        b.push(self.kind());
        match self {
            Ctrl::Hello {
                test,
                rounds,
                max_size,
                qpn,
                psn,
                port,
            } => {
                b.push(*test);
                b.extend_from_slice(&rounds.to_be_bytes());
                b.extend_from_slice(&max_size.to_be_bytes());
                b.extend_from_slice(&qpn.to_be_bytes());
                b.extend_from_slice(&psn.to_be_bytes());
                b.extend_from_slice(&port.to_be_bytes());
            }
            Ctrl::Welcome { qpn, psn, port } => {
                b.extend_from_slice(&qpn.to_be_bytes());
                b.extend_from_slice(&psn.to_be_bytes());
                b.extend_from_slice(&port.to_be_bytes());
            }
            Ctrl::Setup {
                size,
                iters,
                region_len,
                seed,
                peer,
            } => {
                for v in [size, iters, region_len, seed] {
                    b.extend_from_slice(&v.to_be_bytes());
                }
                b.extend_from_slice(&peer.to_bytes());
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
                value,
            } => {
                b.extend_from_slice(&crc.to_be_bytes());
                for v in [check_len, ops, value] {
                    b.extend_from_slice(&v.to_be_bytes());
                }
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
                max_size: r.u64()?,
                qpn: r.u32()?,
                psn: r.u32()?,
                port: r.u16()?,
            },
            2 => Ctrl::Welcome {
                qpn: r.u32()?,
                psn: r.u32()?,
                port: r.u16()?,
            },
            3 => Ctrl::Setup {
                size: r.u64()?,
                iters: r.u64()?,
                region_len: r.u64()?,
                seed: r.u64()?,
                peer: r.region()?,
            },
            4 => Ctrl::Ready {
                region: r.region()?,
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
                value: r.u64()?,
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
                max_size: 1 << 23,
                qpn: 0x12,
                psn: 0xabcdef,
                port: 4791,
            },
            Ctrl::Welcome {
                qpn: 5,
                psn: 6,
                port: 7,
            },
            Ctrl::Setup {
                size: 65536,
                iters: 5000,
                region_len: 1 << 30,
                seed: 99,
                peer: region,
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
                value: u64::MAX,
            },
            Ctrl::Bye,
            Ctrl::Error("no".into()),
        ] {
            assert_eq!(Ctrl::decode(&m.encode()), Some(m));
        }
        assert_eq!(Ctrl::decode(b"MRPF\x02\x07x"), None);
        assert_eq!(Ctrl::decode(b"MRPF\x01\x07"), None, "version 1 is refused");
        assert_eq!(Ctrl::decode(b"hello"), None);
    }
}
