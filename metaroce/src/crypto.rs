//! Optional packet protection: AES-GCM (through `ring`) encryption and integrity of MetaRoCE packets, in the
//! spirit of PSP (Google's PSP Security Protocol) and QUIC packet protection (RFC 9001).
//!
//! When both ends of a connection are configured with the same
//! [`PacketProtectionKey`] (16 bytes: AES-128-GCM, 32 bytes: AES-256-GCM) every packet
//! other than `MR_CONNECT` carries the 24-byte AEAD trailer (trailer kind 2, BTH byte 8
//! bits 1:0) and its payload and pad are encrypted. The headers stay in the clear, so
//! tshark still decodes the BTH, but they are authenticated. docs/PROTOCOL.md ("Packet
//! protection") gives the format byte by byte; this is a summary:
//!
//! ```text
//! BTH (12) | extension headers | payload + pad (encrypted) | PN word (8) | tag (16) | ICRC (4)
//! PN word (big-endian u64): bit 63 = key phase, bits 62:0 = packet number
//! AAD   = BTH with byte 4 set to 0 | extension headers | PN word
//! nonce = IV XOR (0^32 | packet number as big-endian u64)      (RFC 8446 §5.3)
//! ```
//!
//! # Key schedule (HKDF-SHA256, RFC 5869)
//!
//! ```text
//! salt   = client_nonce (8, BE) || server_nonce (8, BE)
//! PRK    = HKDF-Extract(salt, application key)
//! secret = HKDF-Expand(PRK, "metaroce c2s" | "metaroce s2c", 32)
//! key    = HKDF-Expand(secret, "metaroce key", 16 or 32)
//! iv     = HKDF-Expand(secret, "metaroce iv", 12)
//! next secret (key update) = HKDF-Expand(secret, "metaroce ku", 32)
//! ```
//!
//! # Replay protection
//!
//! Packet numbers count up from 0 per direction, over the whole connection (a key update
//! does not reset them), and are never reused: a retransmission is a new transmission with a
//! new packet number. The receiver keeps a sliding window of
//! [`ProtectionConfig::replay_window`] packet numbers below the highest one it has accepted;
//! a packet number seen before, or one below the window, is dropped ([`OpenError::Replay`],
//! [`OpenError::TooOld`]). The window moves only for packets whose tag verified.
//!
//! # Key update
//!
//! Like RFC 9001 §6, the two directions update together: an endpoint initiates an update
//! (on request, [`PacketProtection::request_key_update`], or after
//! [`ProtectionConfig::key_update_packets`] packets under one key) by flipping its send key
//! phase and sealing with the next secret. The peer derives the next receive key when it
//! sees the other phase (the candidate is derived once and cached, so forged packets with the
//! other phase cost one tag check, never a key derivation), promotes it only when a packet
//! verifies with it, and then updates its own send direction too. An endpoint does not
//! initiate another update before it has received a packet under the new key of the other
//! direction (so the peer is known to have the keys); a request made earlier is deferred
//! until then. The receiver keeps the previous key while packets of the previous phase can
//! still fall into the replay window, i.e. until the window's lower edge has passed the
//! first packet number of the current phase: at most `replay_window` packet numbers.
//!
//! Packet numbers grow across generations, so the receiver tells the generations apart
//! beyond the phase bit by the first packet number it verified under each of the last three
//! keys: a packet of the current phase below the previous generation's first packet number
//! is two generations old, one of the other phase below the first packet number of the
//! generation before the previous one is three generations old; both are dropped as
//! [`OpenError::KeyDiscarded`] without a tag check and retransmitted by the delivery layer
//! like a loss. One of the other phase at or above the current generation's first packet
//! number is of the next generation, below it of the previous one.
//!
//! If both ends initiate updates at the same moment, one of them can go on to the next
//! update before any packet of the intermediate generation has reached the peer; the peer
//! then sees a packet of its own phase bit that is two generations ahead. So a packet of
//! the current phase that fails to verify and is newer than every packet seen is tried once
//! more with the key two generations ahead (derived once and cached): a forged packet costs
//! at most two tag checks.
//!
//! Nothing here panics or allocates on untrusted input. All state is per connection.

use core::fmt;

use hkdf::Hkdf;
use ring::aead::{Aad, LessSafeKey, Nonce, Tag, UnboundKey, AES_128_GCM, AES_256_GCM};
use sha2::Sha256;
use zeroize::Zeroize;

use crate::wire::{self, Opcode, BTH_LEN, ICRC_LEN};

/// Size of the AEAD trailer in bytes (24): the 8-byte packet-number word and the 16-byte tag.
pub const AEAD_TRAILER_LEN: usize = 24;
/// Size of the AES-GCM authentication tag in bytes (16).
pub const AEAD_TAG_LEN: usize = 16;
/// Size of the AES-GCM nonce and of the per-direction IV in bytes (12).
pub const AEAD_IV_LEN: usize = 12;
/// Trailer kind value of the AEAD trailer in BTH byte 8 bits 1:0 (2).
pub const TRAILER_KIND_AEAD: u8 = 2;
/// Largest packet number (2^63 − 1): the packet number is bits 62:0 of the trailer word.
pub const MAX_PACKET_NUMBER: u64 = (1 << 63) - 1;
/// Default replay window in packet numbers (1024).
pub const DEFAULT_REPLAY_WINDOW: u32 = 1024;
/// Largest replay window accepted by [`ProtectionConfig::validate`] (65 536 packet numbers,
/// 8 KiB of bitmap per connection).
pub const MAX_REPLAY_WINDOW: u32 = 1 << 16;
/// Default number of packets sealed under one key before an automatic key update (2^23, the
/// AES-GCM confidentiality limit of RFC 9001 §6.6 for packets of up to 2^16 bytes).
pub const DEFAULT_KEY_UPDATE_PACKETS: u64 = 1 << 23;

/// HKDF-Expand label of the client-to-server traffic secret.
pub const LABEL_C2S: &[u8] = b"metaroce c2s";
/// HKDF-Expand label of the server-to-client traffic secret.
pub const LABEL_S2C: &[u8] = b"metaroce s2c";
/// HKDF-Expand label of the AES key, expanded from a traffic secret.
pub const LABEL_KEY: &[u8] = b"metaroce key";
/// HKDF-Expand label of the 12-byte IV, expanded from a traffic secret.
pub const LABEL_IV: &[u8] = b"metaroce iv";
/// HKDF-Expand label of the next traffic secret (key update).
pub const LABEL_KU: &[u8] = b"metaroce ku";

const SECRET_LEN: usize = 32;
/// Largest AAD: BTH (12) + the longest extension headers (48) + the trailer word (8).
const MAX_AAD: usize = BTH_LEN + 48 + 8;

/// The AEAD algorithm, chosen by the length of the application key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AeadAlgorithm {
    /// AES-128-GCM (16-byte key), NIST SP 800-38D.
    Aes128Gcm,
    /// AES-256-GCM (32-byte key), NIST SP 800-38D.
    Aes256Gcm,
}

impl AeadAlgorithm {
    /// Key length in bytes: 16 or 32.
    pub fn key_len(self) -> usize {
        match self {
            AeadAlgorithm::Aes128Gcm => 16,
            AeadAlgorithm::Aes256Gcm => 32,
        }
    }
}

/// The application key both ends of a connection must share (for example exported from the
/// TLS session of the application's control channel, RFC 5705). 16 bytes select
/// AES-128-GCM, 32 bytes AES-256-GCM. `Debug` does not print it; it is zeroed on drop.
#[derive(Clone, PartialEq, Eq)]
pub struct PacketProtectionKey {
    bytes: [u8; 32],
    alg: AeadAlgorithm,
}

/// The application key had a length other than 16 or 32 bytes (the length is given).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyLengthError(pub usize);

impl fmt::Display for KeyLengthError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "packet protection key must be 16 or 32 bytes, got {}",
            self.0
        )
    }
}

impl std::error::Error for KeyLengthError {}

impl PacketProtectionKey {
    /// A key from 16 (AES-128-GCM) or 32 (AES-256-GCM) bytes.
    ///
    /// Errors: [`KeyLengthError`] for any other length.
    pub fn new(key: &[u8]) -> Result<Self, KeyLengthError> {
        let alg = match key.len() {
            16 => AeadAlgorithm::Aes128Gcm,
            32 => AeadAlgorithm::Aes256Gcm,
            n => return Err(KeyLengthError(n)),
        };
        let mut bytes = [0u8; 32];
        bytes[..key.len()].copy_from_slice(key);
        Ok(Self { bytes, alg })
    }

    /// The algorithm this key selects.
    pub fn algorithm(&self) -> AeadAlgorithm {
        self.alg
    }

    fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.alg.key_len()]
    }
}

impl fmt::Debug for PacketProtectionKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PacketProtectionKey({:?}, <redacted>)", self.alg)
    }
}

impl Drop for PacketProtectionKey {
    fn drop(&mut self) {
        self.bytes.zeroize();
    }
}

/// Packet protection parameters of a connection: the shared key and the limits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProtectionConfig {
    /// The application key; both ends must have the same one.
    pub key: PacketProtectionKey,
    /// Replay window in packet numbers, a multiple of 64 in 64..=[`MAX_REPLAY_WINDOW`]. It
    /// must cover the reordering between the fastest and the slowest path, in packets.
    /// Default [`DEFAULT_REPLAY_WINDOW`] (1024).
    pub replay_window: u32,
    /// Packets sealed under one key after which the sender updates its keys by itself;
    /// at least 1. Default [`DEFAULT_KEY_UPDATE_PACKETS`] (2^23).
    pub key_update_packets: u64,
}

impl ProtectionConfig {
    /// Parameters with the given key and the default limits.
    pub fn new(key: PacketProtectionKey) -> Self {
        Self {
            key,
            replay_window: DEFAULT_REPLAY_WINDOW,
            key_update_packets: DEFAULT_KEY_UPDATE_PACKETS,
        }
    }

    /// Check the limits.
    ///
    /// # Errors
    /// A [`ConfigError`](crate::ConfigError) naming `packet_protection.replay_window` or
    /// `packet_protection.key_update_packets`.
    pub fn validate(&self) -> Result<(), crate::ConfigError> {
        if self.replay_window < 64
            || self.replay_window > MAX_REPLAY_WINDOW
            || self.replay_window % 64 != 0
        {
            return Err(crate::ConfigError::new(
                "packet_protection.replay_window",
                format!(
                    "must be a multiple of 64 in 64..={MAX_REPLAY_WINDOW}, got {}",
                    self.replay_window
                ),
            ));
        }
        if self.key_update_packets == 0 {
            return Err(crate::ConfigError::new(
                "packet_protection.key_update_packets",
                "must be at least 1",
            ));
        }
        Ok(())
    }
}

/// Which end of the connection this is: the client sent the `MR_CONNECT` Request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The end that sent the Request: seals with the c2s keys, opens with the s2c keys.
    Client,
    /// The end that sent the Accept: seals with the s2c keys, opens with the c2s keys.
    Server,
}

/// Why [`PacketProtection::seal`] refused a packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SealError {
    /// The buffer is shorter than its headers plus the trailer and the ICRC, or its opcode
    /// is unknown.
    Malformed,
    /// 2^63 packets were sealed in this direction; the connection must end.
    PacketNumberExhausted,
}

impl fmt::Display for SealError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SealError::Malformed => f.write_str("packet too short or unknown opcode for sealing"),
            SealError::PacketNumberExhausted => f.write_str("AEAD packet numbers exhausted"),
        }
    }
}

impl std::error::Error for SealError {}

/// Why [`PacketProtection::open`] dropped a packet. On every error the packet bytes are
/// unchanged and no state has moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpenError {
    /// Not an AEAD packet: shorter than headers + trailer + ICRC, unknown opcode, or trailer
    /// kind (BTH byte 8 bits 1:0) other than 2.
    Malformed,
    /// The packet number was accepted before.
    Replay,
    /// The packet number is below the replay window.
    TooOld,
    /// The packet is of the previous key phase, whose key was already discarded.
    KeyDiscarded,
    /// The tag did not verify: forged, corrupted, or protected with another key.
    Auth,
}

impl fmt::Display for OpenError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            OpenError::Malformed => "not an AEAD-protected packet",
            OpenError::Replay => "AEAD packet number replayed",
            OpenError::TooOld => "AEAD packet number below the replay window",
            OpenError::KeyDiscarded => "AEAD key of the previous phase discarded",
            OpenError::Auth => "AEAD tag did not verify",
        })
    }
}

impl std::error::Error for OpenError {}

/// What [`PacketProtection::open`] found in a packet that verified.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Opened {
    /// Its packet number.
    pub pn: u64,
    /// Its key phase bit.
    pub key_phase: bool,
    /// It was the first packet of the peer's next key phase: the receive key was updated
    /// (and the send direction too, if it had not been already).
    pub key_updated: bool,
}

/// Counters of one connection's packet protection.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProtectionStats {
    /// Packets sealed.
    pub sealed: u64,
    /// Packets opened (tag verified, not a replay).
    pub opened: u64,
    /// Packets whose tag did not verify ([`OpenError::Auth`]).
    pub auth_failures: u64,
    /// Packets dropped as replays or below the window ([`OpenError::Replay`],
    /// [`OpenError::TooOld`]).
    pub replays: u64,
    /// Packets of a discarded previous key phase ([`OpenError::KeyDiscarded`]).
    pub key_discarded: u64,
    /// Packets that were not AEAD packets ([`OpenError::Malformed`]).
    pub malformed: u64,
    /// Key updates of the send direction (initiated or in response).
    pub key_updates_sent: u64,
    /// Key updates of the receive direction (peer's new phase verified).
    pub key_updates_received: u64,
}

/// One generation of one direction: secret, AES-GCM key schedule (`ring`; `None` only if
/// the key could not be set up, which fails every seal and open), IV.
struct KeyMaterial {
    secret: [u8; SECRET_LEN],
    cipher: Option<LessSafeKey>,
    iv: [u8; AEAD_IV_LEN],
}

impl Drop for KeyMaterial {
    fn drop(&mut self) {
        self.secret.zeroize();
        self.iv.zeroize();
    }
}

fn expand(secret: &[u8; SECRET_LEN], label: &[u8], out: &mut [u8]) {
    // A 32-byte PRK is always long enough, and out is at most 32 bytes (<= 255 * 32).
    if let Ok(h) = Hkdf::<Sha256>::from_prk(secret) {
        let _ = h.expand(label, out);
    }
}

/// The two traffic secrets of generation 0, `(c2s, s2c)`, 32 bytes each:
/// `HKDF-Expand(HKDF-Extract(client_nonce || server_nonce, key), label, 32)`.
pub fn traffic_secrets(
    key: &PacketProtectionKey,
    client_nonce: u64,
    server_nonce: u64,
) -> ([u8; 32], [u8; 32]) {
    let mut salt = [0u8; 16];
    salt[..8].copy_from_slice(&client_nonce.to_be_bytes());
    salt[8..].copy_from_slice(&server_nonce.to_be_bytes());
    let hk = Hkdf::<Sha256>::new(Some(&salt), key.as_bytes());
    let mut c2s = [0u8; 32];
    let mut s2c = [0u8; 32];
    // 32 <= 255 * 32: expand cannot fail.
    let _ = hk.expand(LABEL_C2S, &mut c2s);
    let _ = hk.expand(LABEL_S2C, &mut s2c);
    (c2s, s2c)
}

/// The AES key (16 or 32 bytes, in the first `alg.key_len()` bytes of the result) and the
/// 12-byte IV expanded from a traffic secret, and the next secret of a key update.
pub fn expand_secret(
    alg: AeadAlgorithm,
    secret: &[u8; 32],
) -> ([u8; 32], [u8; AEAD_IV_LEN], [u8; 32]) {
    let mut key = [0u8; 32];
    let mut iv = [0u8; AEAD_IV_LEN];
    let mut next = [0u8; 32];
    expand(secret, LABEL_KEY, &mut key[..alg.key_len()]);
    expand(secret, LABEL_IV, &mut iv);
    expand(secret, LABEL_KU, &mut next);
    (key, iv, next)
}

impl KeyMaterial {
    fn new(alg: AeadAlgorithm, secret: [u8; SECRET_LEN]) -> Self {
        let (mut key, iv, mut next) = expand_secret(alg, &secret);
        next.zeroize();
        let (a, k) = match alg {
            AeadAlgorithm::Aes128Gcm => (&AES_128_GCM, &key[..16]),
            AeadAlgorithm::Aes256Gcm => (&AES_256_GCM, &key[..]),
        };
        let cipher = UnboundKey::new(a, k).ok().map(LessSafeKey::new);
        key.zeroize();
        Self { secret, cipher, iv }
    }

    fn next(&self, alg: AeadAlgorithm) -> Self {
        let mut next = [0u8; SECRET_LEN];
        expand(&self.secret, LABEL_KU, &mut next);
        Self::new(alg, next)
    }

    fn nonce(&self, pn: u64) -> [u8; AEAD_IV_LEN] {
        let mut n = self.iv;
        for (b, p) in n[4..].iter_mut().zip(pn.to_be_bytes()) {
            *b ^= p;
        }
        n
    }

    fn seal(&self, pn: u64, aad: &[u8], body: &mut [u8]) -> Option<[u8; AEAD_TAG_LEN]> {
        let nonce = Nonce::assume_unique_for_key(self.nonce(pn));
        let tag = self
            .cipher
            .as_ref()?
            .seal_in_place_separate_tag(nonce, Aad::from(aad), body)
            .ok()?;
        <[u8; AEAD_TAG_LEN]>::try_from(tag.as_ref()).ok()
    }

    /// Verify and decrypt `body` in place. `ring` decrypts while it authenticates and
    /// clears the buffer on failure, so the ciphertext is kept in `backup` and put back:
    /// on failure `body` is unchanged.
    fn open(
        &self,
        pn: u64,
        aad: &[u8],
        body: &mut [u8],
        tag: &[u8; AEAD_TAG_LEN],
        backup: &mut Vec<u8>,
    ) -> bool {
        let Some(k) = &self.cipher else { return false };
        backup.clear();
        backup.extend_from_slice(body);
        let nonce = Nonce::assume_unique_for_key(self.nonce(pn));
        let ok = k
            .open_in_place_separate_tag(nonce, Aad::from(aad), Tag::from(*tag), body, 0..)
            .is_ok();
        if !ok {
            body.copy_from_slice(backup);
        }
        ok
    }
}

/// A sliding window of accepted packet numbers (RFC 4303 §3.4.3 style): the highest
/// accepted number and a bitmap of the `size` numbers at and below it.
#[derive(Debug, Clone)]
pub struct ReplayWindow {
    size: u64,
    /// Highest accepted packet number, `None` before the first.
    top: Option<u64>,
    /// Bit `pn % size` is set when `pn` (within the window) was accepted.
    bits: Vec<u64>,
}

impl ReplayWindow {
    /// An empty window of `size` packet numbers (rounded up to a multiple of 64, at least 64).
    pub fn new(size: u32) -> Self {
        let words = (size.max(64) as usize).div_ceil(64);
        Self {
            size: words as u64 * 64,
            top: None,
            bits: vec![0; words],
        }
    }

    /// Whether `pn` would be accepted: `Err(Replay)` if it was, `Err(TooOld)` if it is at or
    /// below `top - size`.
    pub fn check(&self, pn: u64) -> Result<(), OpenError> {
        let Some(top) = self.top else { return Ok(()) };
        if pn > top {
            return Ok(());
        }
        if top - pn >= self.size {
            return Err(OpenError::TooOld);
        }
        if self.bit(pn) {
            Err(OpenError::Replay)
        } else {
            Ok(())
        }
    }

    /// Record `pn` as accepted (call only after [`check`](Self::check) passed and the tag
    /// verified).
    pub fn mark(&mut self, pn: u64) {
        match self.top {
            Some(top) if pn <= top => {}
            Some(top) => {
                if pn - top >= self.size {
                    self.bits.iter_mut().for_each(|w| *w = 0);
                } else {
                    self.clear_after(top, pn - top);
                }
                self.top = Some(pn);
            }
            None => {
                self.bits.iter_mut().for_each(|w| *w = 0);
                self.top = Some(pn);
            }
        }
        let i = (pn % self.size) as usize;
        if let Some(w) = self.bits.get_mut(i / 64) {
            *w |= 1 << (i % 64);
        }
    }

    /// The highest accepted packet number.
    pub fn top(&self) -> Option<u64> {
        self.top
    }

    /// Size in packet numbers.
    pub fn size(&self) -> u64 {
        self.size
    }

    fn bit(&self, pn: u64) -> bool {
        let i = (pn % self.size) as usize;
        self.bits
            .get(i / 64)
            .is_some_and(|w| w & (1 << (i % 64)) != 0)
    }

    /// Clears the bits of the `n` (< `size`) packet numbers after `top`, a word at a time
    /// (`size` is a multiple of 64, so no word straddles the wrap): a jump of the window
    /// costs O(n / 64), not O(n) (a key holder could jump by nearly `size` per packet).
    fn clear_after(&mut self, top: u64, mut n: u64) {
        let mut p = top.wrapping_add(1);
        while n > 0 {
            let i = (p % self.size) as usize;
            let bit = (i % 64) as u64;
            let take = n.min(64 - bit);
            let mask = if take == 64 {
                u64::MAX
            } else {
                ((1u64 << take) - 1) << bit
            };
            if let Some(w) = self.bits.get_mut(i / 64) {
                *w &= !mask;
            }
            p = p.wrapping_add(take);
            n -= take;
        }
    }
}

struct SendKeys {
    key: KeyMaterial,
    phase: bool,
    generation: u64,
    next_pn: u64,
    sealed_under_key: u64,
}

struct RecvKeys {
    key: KeyMaterial,
    phase: bool,
    generation: u64,
    /// Lowest packet number verified under `key` (0 for generation 0).
    first_pn: u64,
    /// `first_pn` of the previous generation: a packet of the current phase below it is
    /// two generations old (same phase bit), not of the current one.
    prev_first_pn: u64,
    /// `first_pn` of the generation before the previous one: a packet of the other phase
    /// below it is three generations old, not of the previous one.
    prev2_first_pn: u64,
    prev: Option<KeyMaterial>,
    /// The next generation's key, derived when first needed and cached.
    next: Option<KeyMaterial>,
    /// The generation after `next`, for simultaneous updates (see `open`); cached.
    skip: Option<KeyMaterial>,
    replay: ReplayWindow,
}

/// The packet protection state of one connection: send and receive keys, packet numbers,
/// replay window, key phase. Created when the handshake completes.
pub struct PacketProtection {
    alg: AeadAlgorithm,
    key_update_packets: u64,
    send: SendKeys,
    recv: RecvKeys,
    update_requested: bool,
    stats: ProtectionStats,
    /// The ciphertext of the packet being opened, put back if its tag fails.
    backup: Vec<u8>,
}

impl fmt::Debug for PacketProtection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PacketProtection")
            .field("alg", &self.alg)
            .field("send_generation", &self.send.generation)
            .field("recv_generation", &self.recv.generation)
            .field("next_pn", &self.send.next_pn)
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

/// Where the parts of a protected packet are: `(header_len, body_end)`; the body (payload +
/// pad) is `hdr..body_end`, the trailer `body_end..body_end + 24`, the ICRC the last 4 bytes.
fn layout(pkt: &[u8]) -> Option<(usize, usize)> {
    let op = *pkt.first()?;
    let hdr = wire::header_len(Opcode(op)).ok()?;
    let body_end = pkt.len().checked_sub(AEAD_TRAILER_LEN + ICRC_LEN)?;
    // MR_CONNECT (72 bytes of headers) is never protected; every other opcode fits the AAD.
    (body_end >= hdr && hdr >= BTH_LEN && hdr + 8 <= MAX_AAD).then_some((hdr, body_end))
}

/// The AAD of a packet: its BTH and extension headers with BTH byte 4 zeroed, then the
/// 8-byte trailer word. Returns the buffer and the used length.
fn aad(head: &[u8], word: u64) -> ([u8; MAX_AAD], usize) {
    let mut a = [0u8; MAX_AAD];
    let n = head.len().min(MAX_AAD - 8);
    a[..n].copy_from_slice(&head[..n]);
    if n > 4 {
        a[4] = 0;
    }
    a[n..n + 8].copy_from_slice(&word.to_be_bytes());
    (a, n + 8)
}

impl PacketProtection {
    /// The state of one end of a connection whose handshake used these nonces.
    /// `cfg` must have passed [`ProtectionConfig::validate`] (out-of-range limits are clamped).
    pub fn new(cfg: &ProtectionConfig, side: Side, client_nonce: u64, server_nonce: u64) -> Self {
        let alg = cfg.key.algorithm();
        let (c2s, s2c) = traffic_secrets(&cfg.key, client_nonce, server_nonce);
        let (send, recv) = match side {
            Side::Client => (c2s, s2c),
            Side::Server => (s2c, c2s),
        };
        Self {
            alg,
            key_update_packets: cfg.key_update_packets.max(1),
            send: SendKeys {
                key: KeyMaterial::new(alg, send),
                phase: false,
                generation: 0,
                next_pn: 0,
                sealed_under_key: 0,
            },
            recv: RecvKeys {
                key: KeyMaterial::new(alg, recv),
                phase: false,
                generation: 0,
                first_pn: 0,
                prev_first_pn: 0,
                prev2_first_pn: 0,
                prev: None,
                next: None,
                skip: None,
                replay: ReplayWindow::new(cfg.replay_window.min(MAX_REPLAY_WINDOW)),
            },
            update_requested: false,
            stats: ProtectionStats::default(),
            backup: Vec::new(),
        }
    }

    /// The algorithm in use.
    pub fn algorithm(&self) -> AeadAlgorithm {
        self.alg
    }

    /// Counters.
    pub fn stats(&self) -> &ProtectionStats {
        &self.stats
    }

    /// Key generation of the send direction (0 at the start, +1 per update).
    pub fn send_generation(&self) -> u64 {
        self.send.generation
    }

    /// Key generation of the receive direction.
    pub fn recv_generation(&self) -> u64 {
        self.recv.generation
    }

    /// The packet number the next [`seal`](Self::seal) uses.
    pub fn next_packet_number(&self) -> u64 {
        self.send.next_pn
    }

    /// Ask for a key update. It happens at the next [`seal`](Self::seal) if the peer is
    /// known to hold the current keys (a packet under the current generation of the other
    /// direction was received); otherwise it is deferred until then. Returns whether the
    /// update can happen at once.
    pub fn request_key_update(&mut self) -> bool {
        self.update_requested = true;
        self.can_update()
    }

    fn can_update(&self) -> bool {
        self.send.generation <= self.recv.generation
    }

    fn update_send(&mut self) {
        self.send.key = self.send.key.next(self.alg);
        self.send.phase = !self.send.phase;
        self.send.generation += 1;
        self.send.sealed_under_key = 0;
        self.stats.key_updates_sent += 1;
    }

    /// Protect a packet in place and return its packet number.
    ///
    /// `pkt` is a whole UDP payload as emitted, laid out as BTH | extension headers |
    /// payload | pad | 24 trailer bytes (contents ignored) | 4 ICRC bytes; the extension
    /// header length comes from the opcode. Sets the trailer kind (BTH byte 8 bits 1:0) to 2,
    /// writes the trailer word, encrypts payload and pad and writes the tag. Stamp the ICRC
    /// afterwards: it covers the final bytes. Performs a pending or due key update first.
    ///
    /// Errors: [`SealError::Malformed`] if `pkt` is too short for its headers, trailer and
    /// ICRC or its opcode is unknown; [`SealError::PacketNumberExhausted`]. Nothing is
    /// changed on error.
    pub fn seal(&mut self, pkt: &mut [u8]) -> Result<u64, SealError> {
        let (hdr, body_end) = layout(pkt).ok_or(SealError::Malformed)?;
        let pn = self.send.next_pn;
        if pn > MAX_PACKET_NUMBER {
            return Err(SealError::PacketNumberExhausted);
        }
        if (self.update_requested || self.send.sealed_under_key >= self.key_update_packets)
            && self.can_update()
        {
            self.update_requested = false;
            self.update_send();
        }
        pkt[8] = (pkt[8] & !0x03) | TRAILER_KIND_AEAD;
        let word = (u64::from(self.send.phase) << 63) | pn;
        let (head, rest) = pkt.split_at_mut(hdr);
        let (body, tail) = rest.split_at_mut(body_end - hdr);
        let (a, alen) = aad(head, word);
        let tag = self
            .send
            .key
            .seal(pn, &a[..alen], body)
            .ok_or(SealError::Malformed)?;
        tail[..8].copy_from_slice(&word.to_be_bytes());
        tail[8..AEAD_TRAILER_LEN].copy_from_slice(&tag);
        self.send.next_pn += 1;
        self.send.sealed_under_key += 1;
        self.stats.sealed += 1;
        Ok(pn)
    }

    /// Verify and decrypt a packet in place (the inverse of [`seal`](Self::seal)); check the
    /// ICRC before, as it covers the ciphertext. On success payload and pad are plaintext
    /// (the trailer and ICRC bytes are left as they were) and the replay window has moved; on
    /// error nothing has changed and the counter of the error is incremented.
    ///
    /// Checks, in order: layout and trailer kind 2 ([`OpenError::Malformed`]); replay window
    /// ([`OpenError::TooOld`], [`OpenError::Replay`]); key of the phase
    /// ([`OpenError::KeyDiscarded`]); tag ([`OpenError::Auth`]).
    pub fn open(&mut self, pkt: &mut [u8]) -> Result<Opened, OpenError> {
        let r = self.open_inner(pkt);
        match r {
            Ok(_) => self.stats.opened += 1,
            Err(OpenError::Malformed) => self.stats.malformed += 1,
            Err(OpenError::Replay | OpenError::TooOld) => self.stats.replays += 1,
            Err(OpenError::KeyDiscarded) => self.stats.key_discarded += 1,
            Err(OpenError::Auth) => self.stats.auth_failures += 1,
        }
        r
    }

    fn open_inner(&mut self, pkt: &mut [u8]) -> Result<Opened, OpenError> {
        let (hdr, body_end) = layout(pkt).ok_or(OpenError::Malformed)?;
        if pkt[8] & 0x03 != TRAILER_KIND_AEAD {
            return Err(OpenError::Malformed);
        }
        let (head, rest) = pkt.split_at_mut(hdr);
        let (body, tail) = rest.split_at_mut(body_end - hdr);
        let mut w = [0u8; 8];
        w.copy_from_slice(&tail[..8]);
        let word = u64::from_be_bytes(w);
        let mut tag = [0u8; AEAD_TAG_LEN];
        tag.copy_from_slice(&tail[8..AEAD_TRAILER_LEN]);
        let phase = word >> 63 != 0;
        let pn = word & MAX_PACKET_NUMBER;
        self.recv.replay.check(pn)?;
        let (a, alen) = aad(head, word);
        let aad = &a[..alen];

        let r = &mut self.recv;
        let backup = &mut self.backup;
        let mut updated = false;
        if phase == r.phase {
            // Packet numbers grow across generations: below the previous generation's first
            // packet number means two generations back, whose key is gone.
            if pn < r.prev_first_pn {
                return Err(OpenError::KeyDiscarded);
            }
            if r.key.open(pn, aad, body, &tag, backup) {
                r.first_pn = r.first_pn.min(pn);
            } else {
                // Both ends initiated an update at once and the peer went on to the next
                // one before any packet of the intermediate generation arrived: a packet
                // newer than everything seen may be two generations ahead (same phase bit).
                let newest = r.replay.top().is_none_or(|t| pn > t);
                if !newest {
                    return Err(OpenError::Auth);
                }
                let alg = self.alg;
                let next = r.next.get_or_insert_with(|| r.key.next(alg));
                let skip = r.skip.get_or_insert_with(|| next.next(alg));
                if !skip.open(pn, aad, body, &tag, backup) {
                    return Err(OpenError::Auth);
                }
                let top_before = r.replay.top().unwrap_or(0);
                if let (Some(n1), Some(n2)) = (r.next.take(), r.skip.take()) {
                    r.prev = Some(n1);
                    r.key = n2;
                }
                r.generation += 2;
                // The intermediate generation's packets are all newer than what was seen.
                r.prev2_first_pn = r.first_pn;
                r.prev_first_pn = top_before.saturating_add(1);
                r.first_pn = pn;
                updated = true;
                self.stats.key_updates_received += 2;
            }
        } else if pn < r.first_pn {
            let Some(prev) = r.prev.as_ref().filter(|_| pn >= r.prev2_first_pn) else {
                return Err(OpenError::KeyDiscarded);
            };
            if !prev.open(pn, aad, body, &tag, backup) {
                return Err(OpenError::Auth);
            }
        } else {
            let alg = self.alg;
            let next = r.next.get_or_insert_with(|| r.key.next(alg));
            if !next.open(pn, aad, body, &tag, backup) {
                return Err(OpenError::Auth);
            }
            // Promote: the verified next key becomes current, current becomes previous.
            if let Some(n) = r.next.take() {
                r.prev = Some(core::mem::replace(&mut r.key, n));
            }
            r.skip = None;
            r.phase = phase;
            r.generation += 1;
            r.prev2_first_pn = r.prev_first_pn;
            r.prev_first_pn = r.first_pn;
            r.first_pn = pn;
            updated = true;
            self.stats.key_updates_received += 1;
        }
        let r = &mut self.recv;
        r.replay.mark(pn);
        // The previous key is useless once the window's lower edge is past the first packet
        // number of the current phase: every older packet is TooOld anyway.
        if let Some(top) = r.replay.top() {
            if r.prev.is_some() && top.saturating_sub(r.replay.size()) >= r.first_pn {
                r.prev = None;
            }
        }
        while updated && self.recv.generation > self.send.generation {
            self.update_send();
        }
        Ok(Opened {
            pn,
            key_phase: phase,
            key_updated: updated,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{emit_packet, Bth, Headers, PathEth, SendEth};

    proptest::proptest! {
        /// The window against a plain set of accepted numbers: after any sequence of
        /// numbers (jumps of every size, replays, old ones), `check` answers as the set
        /// and the window's rule say (accepted before: replay; at or below top - size: too
        /// old; else fresh). Covers the word-wise clearing of a jump.
        #[test]
        fn replay_window_agrees_with_a_plain_set(
            size in proptest::prop_oneof![proptest::strategy::Just(64u32), 65u32..300],
            steps in proptest::collection::vec((0u64..3, 0u64..700), 1..200),
        ) {
            let mut w = ReplayWindow::new(size);
            let mut seen = std::collections::BTreeSet::new();
            let mut top: Option<u64> = None;
            for (kind, d) in steps {
                let pn = match (kind, top) {
                    (0, Some(t)) => t + 1 + d,
                    (1, Some(t)) => t.saturating_sub(d % (w.size() + 2)),
                    _ => d,
                };
                let want = match top {
                    Some(t) if pn <= t && t - pn >= w.size() => Err(OpenError::TooOld),
                    _ if seen.contains(&pn) => Err(OpenError::Replay),
                    _ => Ok(()),
                };
                proptest::prop_assert_eq!(w.check(pn), want, "pn {}", pn);
                if want.is_ok() {
                    w.mark(pn);
                    seen.insert(pn);
                    top = top.max(Some(pn));
                }
            }
        }
    }

    fn hex(s: &str) -> Vec<u8> {
        let s: String = s.chars().filter(|c| !c.is_whitespace()).collect();
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    /// RFC 5869 Appendix A.1 (test case 1), against the hkdf crate as we use it.
    #[test]
    fn hkdf_rfc5869_test_case_1() {
        let ikm = [0x0b; 22];
        let salt = hex("000102030405060708090a0b0c");
        let info = hex("f0f1f2f3f4f5f6f7f8f9");
        let (prk, hk) = Hkdf::<Sha256>::extract(Some(&salt), &ikm);
        assert_eq!(
            prk.as_slice(),
            hex("077709362c2e32df0ddc3f0dc47bba6390b6c73bb50f9c3122ec844ad7c2b3e5").as_slice()
        );
        let mut okm = [0u8; 42];
        hk.expand(&info, &mut okm).unwrap();
        assert_eq!(
            okm.as_slice(),
            hex("3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf34007208d5b887185865")
                .as_slice()
        );
    }

    /// The GCM specification (McGrew & Viega), test case 4: AES-128, 60-byte plaintext,
    /// 20-byte AAD; and test case 14: AES-256, one zero block; against `ring` as we use it.
    #[test]
    fn aes_gcm_spec_vectors() {
        let seal = |alg, key: &[u8], iv: &[u8], aad: &[u8], buf: &mut [u8]| {
            let k = LessSafeKey::new(UnboundKey::new(alg, key).unwrap());
            let n = Nonce::assume_unique_for_key(iv.try_into().unwrap());
            k.seal_in_place_separate_tag(n, Aad::from(aad), buf)
                .unwrap()
                .as_ref()
                .to_vec()
        };
        let key = hex("feffe9928665731c6d6a8f9467308308");
        let iv = hex("cafebabefacedbaddecaf888");
        let aad = hex("feedfacedeadbeeffeedfacedeadbeefabaddad2");
        let mut buf = hex(
            "d9313225f88406e5a55909c5aff5269a86a7a9531534f7da2e4c303d8a318a72
             1c3c0c95956809532fcf0e2449a6b525b16aedf5aa0de657ba637b39",
        );
        let tag = seal(&AES_128_GCM, &key, &iv, &aad, &mut buf);
        assert_eq!(
            buf,
            hex(
                "42831ec2217774244b7221b784d0d49ce3aa212f2c02a4e035c17e2329aca12e
                 21d514b25466931c7d8f6a5aac84aa051ba30b396a0aac973d58e091"
            )
        );
        assert_eq!(tag, hex("5bc94fbc3221a5db94fae95ae7121a47"));

        let mut buf = [0u8; 16];
        let tag = seal(&AES_256_GCM, &[0u8; 32], &[0u8; 12], &[], &mut buf);
        assert_eq!(
            buf.as_slice(),
            hex("cea7403d4d606b6e074ec5d3baf39d18").as_slice()
        );
        assert_eq!(tag, hex("d0d1c8a799996bf0265b98b5d48ab919"));
    }

    fn key16() -> PacketProtectionKey {
        PacketProtectionKey::new(&(0u8..16).collect::<Vec<_>>()).unwrap()
    }

    fn pair(cfg: &ProtectionConfig) -> (PacketProtection, PacketProtection) {
        let cn = 0x0102_0304_0506_0708;
        let sn = 0x1112_1314_1516_1718;
        (
            PacketProtection::new(cfg, Side::Client, cn, sn),
            PacketProtection::new(cfg, Side::Server, cn, sn),
        )
    }

    /// An MR_SEND of `payload` with room for the AEAD trailer (as the codec will emit it).
    fn packet(payload: &[u8], psn: u32) -> Vec<u8> {
        let bth = Bth::new(Opcode::MR_SEND, 0x12_3456, psn);
        let h = Headers::Send {
            path: PathEth::default(),
            send: SendEth {
                msg_len: payload.len() as u32,
                ..Default::default()
            },
        };
        let n = wire::packet_len(&h, payload.len());
        let mut buf = vec![0u8; n + AEAD_TRAILER_LEN];
        // The codec's 4 zero ICRC bytes and the 24 extra zero bytes become trailer + ICRC.
        emit_packet(&bth, &h, payload, &mut buf[..n]).unwrap();
        buf
    }

    #[test]
    fn seal_open_roundtrip_both_directions_and_algorithms() {
        for k in [key16(), PacketProtectionKey::new(&[7u8; 32]).unwrap()] {
            let (mut c, mut s) = pair(&ProtectionConfig::new(k));
            let hdr = wire::header_len(Opcode::MR_SEND).unwrap();
            for i in 0..10u32 {
                let plain = packet(&[i as u8; 37], i);
                let mut expect = plain.clone();
                expect[8] |= TRAILER_KIND_AEAD;
                let mut p = plain.clone();
                assert_eq!(c.seal(&mut p).unwrap(), u64::from(i));
                assert_ne!(
                    p[hdr..hdr + 37],
                    plain[hdr..hdr + 37],
                    "payload is encrypted"
                );
                assert_eq!(p[..hdr], expect[..hdr], "headers stay in the clear");
                let o = s.open(&mut p).unwrap();
                assert_eq!(o.pn, u64::from(i));
                assert_eq!(
                    p[..hdr + 40],
                    expect[..hdr + 40],
                    "payload and pad decrypted"
                );
                let mut q = packet(b"back", i);
                s.seal(&mut q).unwrap();
                c.open(&mut q).unwrap();
            }
            assert_eq!(s.stats().opened, 10);
            assert_eq!(c.stats().opened, 10);
        }
    }

    #[test]
    fn wrong_direction_or_key_or_nonces_fail() {
        let cfg = ProtectionConfig::new(key16());
        let (mut c, _) = pair(&cfg);
        let (mut c2, _) = pair(&cfg);
        let mut p = packet(b"hello", 1);
        c.seal(&mut p).unwrap();
        // Our own direction's keys do not open: c2s != s2c.
        assert_eq!(c2.open(&mut p.clone()), Err(OpenError::Auth));
        let other = ProtectionConfig::new(PacketProtectionKey::new(&[9u8; 16]).unwrap());
        let mut s = PacketProtection::new(
            &other,
            Side::Server,
            0x0102_0304_0506_0708,
            0x1112_1314_1516_1718,
        );
        assert_eq!(s.open(&mut p.clone()), Err(OpenError::Auth));
        let mut s = PacketProtection::new(
            &cfg,
            Side::Server,
            0x0102_0304_0506_0708,
            0x1112_1314_1516_1719,
        );
        assert_eq!(s.open(&mut p.clone()), Err(OpenError::Auth));
        assert_eq!(s.stats().auth_failures, 1);
    }

    /// Every single-bit flip anywhere in a sealed packet before the ICRC (header, payload,
    /// pad, trailer word, tag) is rejected, except the bits of BTH byte 4 that the ICRC and
    /// the AAD mask (switches rewrite FECN/BECN); nothing moves on rejection.
    #[test]
    fn every_bit_flip_is_rejected() {
        let cfg = ProtectionConfig::new(key16());
        let (mut c, mut s) = pair(&cfg);
        let mut p = packet(b"tamper me!", 5);
        c.seal(&mut p).unwrap();
        let icrc_start = p.len() - ICRC_LEN;
        let mut rejected = 0;
        for byte in 0..icrc_start {
            for bit in 0..8 {
                let mut q = p.clone();
                q[byte] ^= 1 << bit;
                let before = q.clone();
                let r = s.open(&mut q);
                if byte == 4 {
                    assert!(r.is_ok(), "BTH byte 4 is masked");
                    // Accepting it moved the window: start over with a fresh receiver.
                    s = pair(&cfg).1;
                    continue;
                }
                assert!(r.is_err(), "flip of byte {byte} bit {bit} accepted");
                assert_eq!(q, before, "rejected packet changed");
                rejected += 1;
            }
        }
        assert_eq!(rejected, (icrc_start - 1) * 8);
        assert!(s.open(&mut p).is_ok(), "the genuine packet still opens");
    }

    #[test]
    fn replays_and_too_old_rejected() {
        let mut cfg = ProtectionConfig::new(key16());
        cfg.replay_window = 64;
        let (mut c, mut s) = pair(&cfg);
        let mut sealed = Vec::new();
        for i in 0..200 {
            let mut p = packet(b"x", i);
            c.seal(&mut p).unwrap();
            sealed.push(p);
        }
        // Out of order inside the window is fine.
        for i in [5usize, 3, 4, 0, 1, 2] {
            s.open(&mut sealed[i].clone()).unwrap();
        }
        assert_eq!(s.open(&mut sealed[3].clone()), Err(OpenError::Replay));
        s.open(&mut sealed[150].clone()).unwrap();
        assert_eq!(s.open(&mut sealed[150].clone()), Err(OpenError::Replay));
        assert_eq!(s.open(&mut sealed[86].clone()), Err(OpenError::TooOld));
        s.open(&mut sealed[87].clone()).unwrap();
        assert_eq!(s.open(&mut sealed[87].clone()), Err(OpenError::Replay));
        assert_eq!(s.stats().replays, 4);
        // A forged packet with a huge packet number does not move the window.
        let mut f = sealed[151].clone();
        let n = f.len();
        f[n - 28] = 0x7f;
        assert_eq!(s.open(&mut f), Err(OpenError::Auth));
        s.open(&mut sealed[151].clone()).unwrap();
    }

    #[test]
    fn key_update_across_reorder() {
        let cfg = ProtectionConfig::new(key16());
        let (mut c, mut s) = pair(&cfg);
        let mut old = Vec::new();
        for i in 0..10 {
            let mut p = packet(b"old", i);
            c.seal(&mut p).unwrap();
            old.push(p);
        }
        assert!(c.request_key_update());
        let mut new = Vec::new();
        for i in 10..20 {
            let mut p = packet(b"new", i);
            c.seal(&mut p).unwrap();
            new.push(p);
        }
        assert_eq!(c.send_generation(), 1);
        // Deliver: some old, then new, then the rest of the old (reordered across the update).
        for p in &old[..5] {
            assert!(!s.open(&mut p.clone()).unwrap().key_updated);
        }
        assert!(s.open(&mut new[3].clone()).unwrap().key_updated);
        assert_eq!(s.recv_generation(), 1);
        assert_eq!(
            s.send_generation(),
            1,
            "server responded with its own update"
        );
        let hdr = wire::header_len(Opcode::MR_SEND).unwrap();
        for (p, want) in old[5..]
            .iter()
            .map(|p| (p, b"old"))
            .chain(new[..3].iter().chain(&new[4..]).map(|p| (p, b"new")))
        {
            let mut q = p.clone();
            s.open(&mut q).unwrap();
            assert_eq!(&q[hdr..hdr + 3], want);
        }
        assert_eq!(s.stats().opened, 20);
        assert_eq!(s.stats().key_updates_received, 1);
        // A second request is deferred until the client sees the server's new phase.
        assert!(!c.request_key_update());
        let mut p = packet(b"still gen 1", 20);
        c.seal(&mut p).unwrap();
        assert_eq!(c.send_generation(), 1);
        s.open(&mut p).unwrap();
        let mut back = packet(b"ack", 1);
        s.seal(&mut back).unwrap();
        assert!(c.open(&mut back).unwrap().key_updated);
        let mut p = packet(b"gen 2", 21);
        c.seal(&mut p).unwrap();
        assert_eq!(c.send_generation(), 2);
        assert!(s.open(&mut p).unwrap().key_updated);
        assert_eq!(s.recv_generation(), 2);
        // Gen 0 packets are now beyond the discarded key (or the window).
        assert!(s.open(&mut old[0].clone()).is_err());
    }

    #[test]
    fn automatic_key_update_and_previous_key_discarded() {
        let mut cfg = ProtectionConfig::new(key16());
        cfg.key_update_packets = 100;
        cfg.replay_window = 64;
        let (mut c, mut s) = pair(&cfg);
        let mut held = None;
        for i in 0..1000u32 {
            let mut p = packet(b"bulk", i);
            c.seal(&mut p).unwrap();
            if i == 95 {
                held = Some(p);
                continue;
            }
            s.open(&mut p).unwrap();
            let mut a = packet(b"ack", i);
            s.seal(&mut a).unwrap();
            c.open(&mut a).unwrap();
            if i == 110 {
                // Old phase, inside the window: the previous key is still there.
                s.open(&mut held.take().unwrap()).unwrap();
            }
        }
        assert!(c.send_generation() >= 9, "{}", c.send_generation());
        assert_eq!(s.recv_generation(), c.send_generation());
        assert_eq!(s.stats().auth_failures + s.stats().key_discarded, 0);
    }

    /// Both ends initiate at once; the client, confirmed by the server's new phase, updates
    /// again, and its generation-2 packet reaches the server before any generation-1 one.
    #[test]
    fn simultaneous_updates_skip_a_generation() {
        let cfg = ProtectionConfig::new(key16());
        let (mut c, mut s) = pair(&cfg);
        assert!(c.request_key_update());
        assert!(s.request_key_update());
        let mut c1 = packet(b"c gen 1", 0);
        c.seal(&mut c1).unwrap();
        let mut s1 = packet(b"s gen 1", 0);
        s.seal(&mut s1).unwrap();
        assert_eq!((c.send_generation(), s.send_generation()), (1, 1));
        assert!(c.open(&mut s1).unwrap().key_updated);
        assert!(c.request_key_update());
        let mut c2 = packet(b"c gen 2", 1);
        c.seal(&mut c2).unwrap();
        assert_eq!(c.send_generation(), 2);
        let o = s.open(&mut c2).unwrap();
        assert!(o.key_updated);
        assert_eq!(s.recv_generation(), 2);
        assert_eq!(s.send_generation(), 2, "the server follows");
        s.open(&mut c1).unwrap();
        assert_eq!(s.stats().auth_failures, 0);
        let mut s2 = packet(b"s gen 2", 1);
        s.seal(&mut s2).unwrap();
        assert!(c.open(&mut s2).unwrap().key_updated);
        assert_eq!(c.recv_generation(), 2);
    }

    #[test]
    fn forged_other_phase_does_not_update() {
        let cfg = ProtectionConfig::new(key16());
        let (mut c, mut s) = pair(&cfg);
        let mut p = packet(b"x", 0);
        c.seal(&mut p).unwrap();
        let n = p.len();
        p[n - 28] |= 0x80; // flip phase bit
        assert_eq!(s.open(&mut p), Err(OpenError::Auth));
        assert_eq!(s.recv_generation(), 0);
        assert_eq!(s.send_generation(), 0);
    }

    #[test]
    fn malformed_inputs() {
        let cfg = ProtectionConfig::new(key16());
        let (mut c, mut s) = pair(&cfg);
        for len in 0..40 {
            assert!(s.open(&mut vec![0xC0; len]).is_err());
        }
        assert_eq!(c.seal(&mut [0u8; 10]), Err(SealError::Malformed));
        let mut p = packet(b"x", 0);
        c.seal(&mut p).unwrap();
        p[8] &= !0x03;
        assert_eq!(s.open(&mut p), Err(OpenError::Malformed));
        assert!(PacketProtectionKey::new(&[0; 24]).is_err());
        assert!(format!("{:?}", key16()).contains("redacted"));
    }

    /// The packet-level known-answer test written down in docs/PROTOCOL.md
    /// ("Packet protection: worked example").
    #[test]
    fn packet_kat() {
        let cfg = ProtectionConfig::new(key16());
        let (mut c, _) = pair(&cfg);
        let (c2s, _) = traffic_secrets(&cfg.key, 0x0102_0304_0506_0708, 0x1112_1314_1516_1718);
        let (key, iv, _) = expand_secret(AeadAlgorithm::Aes128Gcm, &c2s);
        let mut p = packet(b"hello", 7);
        c.seal(&mut p).unwrap();
        let h = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
        println!("c2s secret {}", h(&c2s));
        println!("key {}", h(&key[..16]));
        println!("iv {}", h(&iv));
        println!("packet {}", h(&p));
        assert_eq!(h(&c2s), KAT_C2S);
        assert_eq!(h(&key[..16]), KAT_KEY);
        assert_eq!(h(&iv), KAT_IV);
        assert_eq!(h(&p), KAT_PACKET);
    }

    const KAT_C2S: &str = "bd463f323848e64aa39b3ee5117a8cf5e615d0a40a98b2183b9809157106feab";
    const KAT_KEY: &str = "72ea94b020b95ec22baf0bebcdb0f169";
    const KAT_IV: &str = "293a8f111164412c78a85e23";
    const KAT_PACKET: &str = concat!(
        "c230ffff0012345602000007",
        "000000000000000000000000",
        "00000000000000000000000000000005",
        "9f940110",
        "49c7981e", // "hello" + 3 pad bytes, encrypted
        "0000000000000000",
        "7b7ce71d7f61782925431fc215daa04f",
        "00000000", // ICRC, stamped later
    );
}
