//! The only module with `unsafe` (with `buf.rs`): libibverbs loaded with `dlopen` at run
//! time, the few C structures the crate passes to it, and thin wrappers around each call.
//!
//! Layouts are those of rdma-core's `<infiniband/verbs.h>` (ABI `IBVERBS_1.1`, stable since
//! rdma-core 13; checked against rdma-core 44 with `offsetof`, the sizes are asserted at
//! compile time below). Only the exported symbols of `libibverbs.so.1` are resolved; the
//! data-path calls that `verbs.h` defines as `static inline` (`ibv_post_send`,
//! `ibv_post_recv`, `ibv_poll_cq`, `ibv_req_notify_cq`) go, as those inlines do, through the
//! provider's function table `ibv_context::ops`.
#![allow(non_camel_case_types, missing_debug_implementations)]

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::OnceLock;

/// `struct ibv_sge`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

/// The `wr` union of `struct ibv_send_wr` (rdma / atomic arms; 32 bytes).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct send_wr_u {
    /// rdma.remote_addr / atomic.remote_addr
    pub remote_addr: u64,
    /// rdma.rkey (low 32 bits) / atomic.compare_add
    pub word1: u64,
    /// atomic.swap
    pub swap: u64,
    /// atomic.rkey
    pub atomic_rkey: u32,
    pub _pad: u32,
}

/// `struct ibv_send_wr` (128 bytes).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_send_wr {
    pub wr_id: u64,
    pub next: *mut ibv_send_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
    pub opcode: u32,
    pub send_flags: u32,
    /// Network byte order (`__be32`).
    pub imm_data: u32,
    pub wr: send_wr_u,
    /// qp_type union (xrc remote_srqn) + bind_mw/tso union: unused by RC.
    pub _tail: [u64; 7],
}

/// `struct ibv_recv_wr`.
#[repr(C)]
pub struct ibv_recv_wr {
    pub wr_id: u64,
    pub next: *mut ibv_recv_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
}

/// `struct ibv_wc` (48 bytes).
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct ibv_wc {
    pub wr_id: u64,
    pub status: u32,
    pub opcode: u32,
    pub vendor_err: u32,
    pub byte_len: u32,
    /// Network byte order.
    pub imm_data: u32,
    pub qp_num: u32,
    pub src_qp: u32,
    pub wc_flags: u32,
    pub pkey_index: u16,
    pub slid: u16,
    pub sl: u8,
    pub dlid_path_bits: u8,
}

/// `struct ibv_global_route` (24 bytes, 8-aligned: `union ibv_gid` holds two `__be64`).
#[repr(C, align(8))]
#[derive(Clone, Copy, Default)]
pub struct ibv_global_route {
    pub dgid: [u8; 16],
    pub flow_label: u32,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
}

/// `struct ibv_ah_attr` (32 bytes).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_ah_attr {
    pub grh: ibv_global_route,
    pub dlid: u16,
    pub sl: u8,
    pub src_path_bits: u8,
    pub static_rate: u8,
    pub is_global: u8,
    pub port_num: u8,
}

/// `struct ibv_qp_cap`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_qp_cap {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

/// `struct ibv_qp_attr` (144 bytes).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_qp_attr {
    pub qp_state: u32,
    pub cur_qp_state: u32,
    pub path_mtu: u32,
    pub path_mig_state: u32,
    pub qkey: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub dest_qp_num: u32,
    pub qp_access_flags: c_int,
    pub cap: ibv_qp_cap,
    pub ah_attr: ibv_ah_attr,
    pub alt_ah_attr: ibv_ah_attr,
    pub pkey_index: u16,
    pub alt_pkey_index: u16,
    pub en_sqd_async_notify: u8,
    pub sq_draining: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub port_num: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub alt_port_num: u8,
    pub alt_timeout: u8,
    pub rate_limit: u32,
}

/// `struct ibv_qp_init_attr` (64 bytes).
#[repr(C)]
pub struct ibv_qp_init_attr {
    pub qp_context: *mut c_void,
    pub send_cq: *mut c_void,
    pub recv_cq: *mut c_void,
    pub srq: *mut c_void,
    pub cap: ibv_qp_cap,
    pub qp_type: u32,
    pub sq_sig_all: c_int,
}

/// `struct ibv_port_attr` (52 bytes; the buffer passed is larger, zeroed).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_port_attr {
    pub state: u32,
    pub max_mtu: u32,
    pub active_mtu: u32,
    pub gid_tbl_len: c_int,
    pub _rest: [u8; 30],
    pub link_layer: u8,
    pub _tail: [u8; 17],
}

/// Prefix of `struct ibv_context`: the device and the provider's ops table.
#[repr(C)]
struct ibv_context {
    device: *mut c_void,
    ops: ibv_context_ops,
}

type PollCq = unsafe extern "C" fn(*mut c_void, c_int, *mut ibv_wc) -> c_int;
type ReqNotifyCq = unsafe extern "C" fn(*mut c_void, c_int) -> c_int;
type PostSend = unsafe extern "C" fn(*mut c_void, *mut ibv_send_wr, *mut *mut ibv_send_wr) -> c_int;
type PostRecv = unsafe extern "C" fn(*mut c_void, *mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> c_int;

/// `struct ibv_context_ops`, up to `post_recv` (index 26 of 32 pointers; offsets checked
/// with `offsetof` against rdma-core 44's verbs.h: poll_cq 88, post_send 200).
#[repr(C)]
struct ibv_context_ops {
    _a: [usize; 11],
    poll_cq: Option<PollCq>,
    req_notify_cq: Option<ReqNotifyCq>,
    _b: [usize; 12],
    post_send: Option<PostSend>,
    post_recv: Option<PostRecv>,
}

/// Prefix of `struct ibv_mr`.
#[repr(C)]
struct ibv_mr {
    context: *mut c_void,
    pd: *mut c_void,
    addr: *mut c_void,
    length: usize,
    handle: u32,
    lkey: u32,
    rkey: u32,
}

/// Prefix of `struct ibv_qp`.
#[repr(C)]
struct ibv_qp {
    context: *mut c_void,
    qp_context: *mut c_void,
    pd: *mut c_void,
    send_cq: *mut c_void,
    recv_cq: *mut c_void,
    srq: *mut c_void,
    handle: u32,
    qp_num: u32,
    state: u32,
}

/// Prefix of `struct ibv_cq`.
#[repr(C)]
struct ibv_cq {
    context: *mut ibv_context,
}

/// Prefix of `struct ibv_comp_channel`.
#[repr(C)]
struct ibv_comp_channel {
    context: *mut c_void,
    fd: c_int,
}

const _: () = {
    assert!(std::mem::size_of::<ibv_sge>() == 16);
    assert!(std::mem::size_of::<ibv_send_wr>() == 128);
    assert!(std::mem::offset_of!(ibv_send_wr, wr) == 40);
    assert!(std::mem::size_of::<ibv_recv_wr>() == 32);
    assert!(std::mem::size_of::<ibv_wc>() == 48);
    assert!(std::mem::size_of::<ibv_ah_attr>() == 32);
    assert!(std::mem::size_of::<ibv_qp_attr>() == 144);
    assert!(std::mem::offset_of!(ibv_qp_attr, ah_attr) == 56);
    assert!(std::mem::offset_of!(ibv_qp_attr, max_rd_atomic) == 126);
    assert!(std::mem::offset_of!(ibv_qp_attr, rate_limit) == 136);
    assert!(std::mem::size_of::<ibv_qp_init_attr>() == 64);
    assert!(std::mem::offset_of!(ibv_port_attr, link_layer) == 46);
    assert!(std::mem::offset_of!(ibv_context, ops) == 8);
    assert!(std::mem::offset_of!(ibv_context_ops, poll_cq) == 88);
    assert!(std::mem::offset_of!(ibv_context_ops, req_notify_cq) == 96);
    assert!(std::mem::offset_of!(ibv_context_ops, post_send) == 200);
    assert!(std::mem::offset_of!(ibv_context_ops, post_recv) == 208);
    assert!(std::mem::offset_of!(ibv_mr, lkey) == 36);
    assert!(std::mem::offset_of!(ibv_qp, qp_num) == 52);
    assert!(std::mem::offset_of!(ibv_comp_channel, fd) == 8);
};

/// The exported libibverbs functions the crate calls.
struct Lib {
    _lib: libloading::Library,
    get_device_list: unsafe extern "C" fn(*mut c_int) -> *mut *mut c_void,
    free_device_list: unsafe extern "C" fn(*mut *mut c_void),
    get_device_name: unsafe extern "C" fn(*mut c_void) -> *const c_char,
    open_device: unsafe extern "C" fn(*mut c_void) -> *mut c_void,
    close_device: unsafe extern "C" fn(*mut c_void) -> c_int,
    query_port: unsafe extern "C" fn(*mut c_void, u8, *mut ibv_port_attr) -> c_int,
    query_gid: unsafe extern "C" fn(*mut c_void, u8, c_int, *mut [u8; 16]) -> c_int,
    alloc_pd: unsafe extern "C" fn(*mut c_void) -> *mut c_void,
    dealloc_pd: unsafe extern "C" fn(*mut c_void) -> c_int,
    reg_mr: unsafe extern "C" fn(*mut c_void, *mut c_void, usize, c_int) -> *mut c_void,
    dereg_mr: unsafe extern "C" fn(*mut c_void) -> c_int,
    create_comp_channel: unsafe extern "C" fn(*mut c_void) -> *mut c_void,
    destroy_comp_channel: unsafe extern "C" fn(*mut c_void) -> c_int,
    create_cq:
        unsafe extern "C" fn(*mut c_void, c_int, *mut c_void, *mut c_void, c_int) -> *mut c_void,
    destroy_cq: unsafe extern "C" fn(*mut c_void) -> c_int,
    get_cq_event: unsafe extern "C" fn(*mut c_void, *mut *mut c_void, *mut *mut c_void) -> c_int,
    ack_cq_events: unsafe extern "C" fn(*mut c_void, u32),
    create_qp: unsafe extern "C" fn(*mut c_void, *mut ibv_qp_init_attr) -> *mut c_void,
    modify_qp: unsafe extern "C" fn(*mut c_void, *mut ibv_qp_attr, c_int) -> c_int,
    destroy_qp: unsafe extern "C" fn(*mut c_void) -> c_int,
}

/// Names tried, in order, by [`lib`].
pub const LIB_NAMES: [&str; 2] = ["libibverbs.so.1", "libibverbs.so"];

static LIB: OnceLock<Result<Lib, String>> = OnceLock::new();

fn load() -> Result<Lib, String> {
    let mut last = String::new();
    for name in LIB_NAMES {
        // SAFETY: loading libibverbs runs its ELF constructors, which only initialise the
        // library's own state (rdma-core's verbs init happens lazily in ibv_get_device_list).
        match unsafe { libloading::Library::new(name) } {
            Ok(lib) => return resolve(lib),
            Err(e) => last = format!("{name}: {e}"),
        }
    }
    Err(last)
}

fn resolve(lib: libloading::Library) -> Result<Lib, String> {
    macro_rules! sym {
        ($name:literal) => {{
            // SAFETY: the symbol is libibverbs' exported function of that name; the
            // function pointer type it is read as matches its C prototype in verbs.h
            // (IBVERBS_1.1). The pointer is only used while `lib` is kept alive in `Lib`.
            let s = unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                .map_err(|e| format!("libibverbs: {}: {e}", $name))?;
            *s
        }};
    }
    Ok(Lib {
        get_device_list: sym!("ibv_get_device_list"),
        free_device_list: sym!("ibv_free_device_list"),
        get_device_name: sym!("ibv_get_device_name"),
        open_device: sym!("ibv_open_device"),
        close_device: sym!("ibv_close_device"),
        query_port: sym!("ibv_query_port"),
        query_gid: sym!("ibv_query_gid"),
        alloc_pd: sym!("ibv_alloc_pd"),
        dealloc_pd: sym!("ibv_dealloc_pd"),
        reg_mr: sym!("ibv_reg_mr"),
        dereg_mr: sym!("ibv_dereg_mr"),
        create_comp_channel: sym!("ibv_create_comp_channel"),
        destroy_comp_channel: sym!("ibv_destroy_comp_channel"),
        create_cq: sym!("ibv_create_cq"),
        destroy_cq: sym!("ibv_destroy_cq"),
        get_cq_event: sym!("ibv_get_cq_event"),
        ack_cq_events: sym!("ibv_ack_cq_events"),
        create_qp: sym!("ibv_create_qp"),
        modify_qp: sym!("ibv_modify_qp"),
        destroy_qp: sym!("ibv_destroy_qp"),
        _lib: lib,
    })
}

fn lib() -> Result<&'static Lib, String> {
    LIB.get_or_init(load).as_ref().map_err(Clone::clone)
}

fn errno() -> std::io::Error {
    std::io::Error::last_os_error()
}

fn io_rc(rc: c_int) -> std::io::Result<()> {
    if rc == 0 {
        Ok(())
    } else if rc < 0 {
        Err(errno())
    } else {
        Err(std::io::Error::from_raw_os_error(rc))
    }
}

/// An opaque verbs object pointer (`ibv_context *`, `ibv_pd *`, ...). Verbs objects may be
/// used from any thread (libibverbs is thread safe); ownership rules are kept by the safe
/// types that hold these.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Raw(pub(crate) *mut c_void);
// SAFETY: libibverbs objects are thread safe (rdma-core documents every verb as callable
// from any thread); the pointer is only dereferenced by libibverbs or by the reads below.
unsafe impl Send for Raw {}
// SAFETY: as above.
unsafe impl Sync for Raw {}

/// Names of the RDMA devices present (`ibv_get_device_list`).
pub fn device_names() -> Result<Vec<String>, String> {
    let l = lib()?;
    let mut n: c_int = 0;
    // SAFETY: ibv_get_device_list writes the count and returns a NULL-terminated array (or
    // NULL on error) that we free below with ibv_free_device_list.
    let list = unsafe { (l.get_device_list)(&mut n) };
    if list.is_null() {
        return Err(format!("ibv_get_device_list: {}", errno()));
    }
    let mut out = Vec::new();
    for i in 0..n.max(0) as usize {
        // SAFETY: i < n entries of the array are valid device pointers; the name is a
        // NUL-terminated string owned by the device, copied before the list is freed.
        unsafe {
            let dev = *list.add(i);
            let name = (l.get_device_name)(dev);
            if !name.is_null() {
                out.push(CStr::from_ptr(name).to_string_lossy().into_owned());
            }
        }
    }
    // SAFETY: list came from ibv_get_device_list and is freed once.
    unsafe { (l.free_device_list)(list) };
    Ok(out)
}

/// `ibv_open_device` on the device called `name`.
pub fn open_device(name: &str) -> Result<Option<Raw>, String> {
    let l = lib()?;
    let mut n: c_int = 0;
    // SAFETY: see device_names.
    let list = unsafe { (l.get_device_list)(&mut n) };
    if list.is_null() {
        return Err(format!("ibv_get_device_list: {}", errno()));
    }
    let mut ctx = None;
    for i in 0..n.max(0) as usize {
        // SAFETY: see device_names; ibv_open_device on a listed device returns a context
        // (or NULL), which stays valid after the list is freed (verbs.h says so).
        unsafe {
            let dev = *list.add(i);
            let p = (l.get_device_name)(dev);
            if !p.is_null() && CStr::from_ptr(p).to_bytes() == name.as_bytes() {
                let c = (l.open_device)(dev);
                if c.is_null() {
                    (l.free_device_list)(list);
                    return Err(format!("ibv_open_device({name}): {}", errno()));
                }
                ctx = Some(Raw(c));
                break;
            }
        }
    }
    // SAFETY: list freed once.
    unsafe { (l.free_device_list)(list) };
    Ok(ctx)
}

macro_rules! lib_or_panic {
    () => {
        // Every Raw was made after lib() succeeded, so this cannot fail.
        lib().expect("libibverbs loaded before any verbs object existed")
    };
}

/// `ibv_close_device`.
///
/// # Safety
/// `ctx` came from [`open_device`], is closed once, and every object made from it was
/// destroyed; no copy of it is used afterwards.
pub unsafe fn close_device(ctx: Raw) {
    // SAFETY: the caller's contract.
    unsafe { (lib_or_panic!().close_device)(ctx.0) };
}

/// `ibv_query_port`.
pub fn query_port(ctx: Raw, port: u8) -> std::io::Result<ibv_port_attr> {
    let mut a = ibv_port_attr {
        state: 0,
        max_mtu: 0,
        active_mtu: 0,
        gid_tbl_len: 0,
        _rest: [0; 30],
        link_layer: 0,
        _tail: [0; 17],
    };
    // SAFETY: ctx is an open context; `a` is a writable ibv_port_attr (rdma-core's compat
    // ibv_query_port fills at most sizeof(struct ibv_port_attr) = 52 bytes; ours is 64).
    io_rc(unsafe { (lib_or_panic!().query_port)(ctx.0, port, &mut a) })?;
    Ok(a)
}

/// `ibv_query_gid`.
pub fn query_gid(ctx: Raw, port: u8, index: i32) -> std::io::Result<[u8; 16]> {
    let mut g = [0u8; 16];
    // SAFETY: ctx is open; g is a 16-byte union ibv_gid.
    io_rc(unsafe { (lib_or_panic!().query_gid)(ctx.0, port, index, &mut g) })?;
    Ok(g)
}

/// `ibv_alloc_pd`.
pub fn alloc_pd(ctx: Raw) -> std::io::Result<Raw> {
    // SAFETY: ctx is open.
    let p = unsafe { (lib_or_panic!().alloc_pd)(ctx.0) };
    if p.is_null() {
        Err(errno())
    } else {
        Ok(Raw(p))
    }
}

/// `ibv_dealloc_pd`.
///
/// # Safety
/// `pd` came from [`alloc_pd`], is deallocated once, its MRs and QPs are gone, and no copy
/// of it is used afterwards.
pub unsafe fn dealloc_pd(pd: Raw) {
    // SAFETY: the caller's contract.
    unsafe { (lib_or_panic!().dealloc_pd)(pd.0) };
}

/// A registered MR: its handle and keys.
#[derive(Debug, Clone, Copy)]
pub struct MrRaw {
    pub raw: Raw,
    pub lkey: u32,
    pub rkey: u32,
}

/// `ibv_reg_mr` over `[addr, addr + len)`.
///
/// # Safety
/// The memory must stay valid and not be freed until [`dereg_mr`] returned.
pub unsafe fn reg_mr(pd: Raw, addr: *mut u8, len: usize, access: i32) -> std::io::Result<MrRaw> {
    // SAFETY: the caller keeps the memory alive until dereg; pd is a live PD.
    let p = unsafe { (lib_or_panic!().reg_mr)(pd.0, addr.cast(), len, access) };
    if p.is_null() {
        return Err(errno());
    }
    // SAFETY: p is a live struct ibv_mr returned by ibv_reg_mr.
    let m = unsafe { &*(p as *const ibv_mr) };
    Ok(MrRaw {
        raw: Raw(p),
        lkey: m.lkey,
        rkey: m.rkey,
    })
}

/// `ibv_dereg_mr`.
///
/// # Safety
/// `mr` came from [`reg_mr`] and was not deregistered successfully before; after `Ok` no
/// copy of it is used. (After an error the MR is still registered.)
pub unsafe fn dereg_mr(mr: Raw) -> std::io::Result<()> {
    // SAFETY: the caller's contract.
    io_rc(unsafe { (lib_or_panic!().dereg_mr)(mr.0) })
}

/// `ibv_create_comp_channel`, returning it and its fd.
pub fn create_comp_channel(ctx: Raw) -> std::io::Result<(Raw, c_int)> {
    // SAFETY: ctx is open.
    let p = unsafe { (lib_or_panic!().create_comp_channel)(ctx.0) };
    if p.is_null() {
        return Err(errno());
    }
    // SAFETY: p is a live struct ibv_comp_channel; fd is its second field.
    let fd = unsafe { (*(p as *const ibv_comp_channel)).fd };
    Ok((Raw(p), fd))
}

/// `ibv_destroy_comp_channel`.
///
/// # Safety
/// `ch` came from [`create_comp_channel`], is destroyed once, its CQs were destroyed
/// before, and no copy of it is used afterwards.
pub unsafe fn destroy_comp_channel(ch: Raw) {
    // SAFETY: the caller's contract.
    unsafe { (lib_or_panic!().destroy_comp_channel)(ch.0) };
}

/// `ibv_create_cq` with `cqe` entries on completion channel `ch`.
pub fn create_cq(ctx: Raw, cqe: i32, ch: Raw) -> std::io::Result<Raw> {
    // SAFETY: ctx and ch are live; cq_context NULL; comp_vector 0.
    let p = unsafe { (lib_or_panic!().create_cq)(ctx.0, cqe, std::ptr::null_mut(), ch.0, 0) };
    if p.is_null() {
        Err(errno())
    } else {
        Ok(Raw(p))
    }
}

/// `ibv_destroy_cq`.
///
/// # Safety
/// `cq` came from [`create_cq`] and was not destroyed successfully before; its QPs were
/// destroyed and every event acknowledged; after `Ok` no copy of it is used.
pub unsafe fn destroy_cq(cq: Raw) -> std::io::Result<()> {
    // SAFETY: the caller's contract.
    io_rc(unsafe { (lib_or_panic!().destroy_cq)(cq.0) })
}

/// `ibv_get_cq_event` on a non-blocking channel: `Ok(true)` if an event was read (and
/// acknowledged at once), `Ok(false)` if none was pending.
pub fn get_and_ack_cq_event(ch: Raw) -> std::io::Result<bool> {
    let mut cq: *mut c_void = std::ptr::null_mut();
    let mut ctx: *mut c_void = std::ptr::null_mut();
    // SAFETY: ch is a live channel whose fd is O_NONBLOCK; the out pointers are valid.
    let rc = unsafe { (lib_or_panic!().get_cq_event)(ch.0, &mut cq, &mut ctx) };
    if rc != 0 {
        let e = errno();
        return if e.kind() == std::io::ErrorKind::WouldBlock {
            Ok(false)
        } else {
            Err(e)
        };
    }
    // SAFETY: cq is the CQ the event was for; ack exactly the one event we got.
    unsafe { (lib_or_panic!().ack_cq_events)(cq, 1) };
    Ok(true)
}

fn cq_ops(cq: Raw) -> &'static ibv_context_ops {
    // SAFETY: a live ibv_cq starts with its ibv_context pointer; a context outlives its
    // CQs and its ops table is never modified after ibv_open_device. The 'static is
    // confined to this module's callers, who use it for one call on a live CQ.
    unsafe { &(*(*(cq.0 as *const ibv_cq)).context).ops }
}

/// `ibv_poll_cq`: fills `out`, returns how many completions were written.
pub fn poll_cq(cq: Raw, out: &mut [ibv_wc]) -> std::io::Result<usize> {
    let f = cq_ops(cq)
        .poll_cq
        .ok_or_else(|| std::io::Error::other("provider has no poll_cq"))?;
    // SAFETY: cq is live; out has out.len() writable entries.
    let n = unsafe {
        f(
            cq.0,
            out.len().min(i32::MAX as usize) as c_int,
            out.as_mut_ptr(),
        )
    };
    if n < 0 {
        Err(std::io::Error::other(format!("ibv_poll_cq failed ({n})")))
    } else {
        // A provider never returns more than asked; clamp anyway so callers can slice.
        Ok((n as usize).min(out.len()))
    }
}

/// `ibv_req_notify_cq(cq, 0)`.
pub fn req_notify_cq(cq: Raw) -> std::io::Result<()> {
    let f = cq_ops(cq)
        .req_notify_cq
        .ok_or_else(|| std::io::Error::other("provider has no req_notify_cq"))?;
    // SAFETY: cq is live.
    io_rc(unsafe { f(cq.0, 0) })
}

/// `ibv_create_qp` (RC, `sq_sig_all` 0): the QP and its QPN.
pub fn create_rc_qp(pd: Raw, cq: Raw, cap: ibv_qp_cap) -> std::io::Result<(Raw, u32)> {
    let mut a = ibv_qp_init_attr {
        qp_context: std::ptr::null_mut(),
        send_cq: cq.0,
        recv_cq: cq.0,
        srq: std::ptr::null_mut(),
        cap,
        qp_type: 2, // IBV_QPT_RC
        sq_sig_all: 0,
    };
    // SAFETY: pd and cq are live; a is a valid init attr.
    let p = unsafe { (lib_or_panic!().create_qp)(pd.0, &mut a) };
    if p.is_null() {
        return Err(errno());
    }
    // SAFETY: p is a live struct ibv_qp.
    let qpn = unsafe { (*(p as *const ibv_qp)).qp_num };
    Ok((Raw(p), qpn))
}

/// `ibv_modify_qp`.
pub fn modify_qp(qp: Raw, attr: &mut ibv_qp_attr, mask: i32) -> std::io::Result<()> {
    // SAFETY: qp is live; attr is a valid ibv_qp_attr.
    io_rc(unsafe { (lib_or_panic!().modify_qp)(qp.0, attr, mask) })
}

/// `ibv_destroy_qp`.
///
/// # Safety
/// `qp` came from [`create_rc_qp`] and was not destroyed successfully before; after `Ok`
/// no copy of it is used.
pub unsafe fn destroy_qp(qp: Raw) -> std::io::Result<()> {
    // SAFETY: the caller's contract.
    io_rc(unsafe { (lib_or_panic!().destroy_qp)(qp.0) })
}

fn qp_ops(qp: Raw) -> &'static ibv_context_ops {
    // SAFETY: a live ibv_qp starts with its ibv_context pointer (see cq_ops).
    unsafe { &(*(*(qp.0 as *const ibv_qp)).context.cast::<ibv_context>()).ops }
}

/// `ibv_post_send` of one work request with one SGE (or none when `sge.length` is 0 and
/// `num_sge` 0).
///
/// # Safety
/// The memory the SGE names (and for RDMA READ / atomics, which the device writes) must
/// stay registered and valid until the work request's completion has been polled.
pub unsafe fn post_send(
    qp: Raw,
    wr: &mut ibv_send_wr,
    sge: Option<&mut ibv_sge>,
) -> std::io::Result<()> {
    let f = qp_ops(qp)
        .post_send
        .ok_or_else(|| std::io::Error::other("provider has no post_send"))?;
    wr.next = std::ptr::null_mut();
    match sge {
        Some(s) => {
            wr.sg_list = s;
            wr.num_sge = 1;
        }
        None => {
            wr.sg_list = std::ptr::null_mut();
            wr.num_sge = 0;
        }
    }
    let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
    // SAFETY: qp is live; wr/sge are valid for the call (the provider copies them into its
    // WQE); the caller keeps the memory named by the SGE registered until completion.
    io_rc(unsafe { f(qp.0, wr, &mut bad) })
}

/// `ibv_post_recv` of one receive WR with one SGE.
///
/// # Safety
/// The memory the SGE names must stay registered and valid until the completion has been
/// polled.
pub unsafe fn post_recv(qp: Raw, wr_id: u64, sge: &mut ibv_sge) -> std::io::Result<()> {
    let f = qp_ops(qp)
        .post_recv
        .ok_or_else(|| std::io::Error::other("provider has no post_recv"))?;
    let mut wr = ibv_recv_wr {
        wr_id,
        next: std::ptr::null_mut(),
        sg_list: sge,
        num_sge: 1,
    };
    let mut bad: *mut ibv_recv_wr = std::ptr::null_mut();
    // SAFETY: as for post_send.
    io_rc(unsafe { f(qp.0, &mut wr, &mut bad) })
}

/// A completion channel's fd, registered with tokio (read readiness only).
#[derive(Debug)]
pub struct ChannelFd(c_int);

impl std::os::fd::AsRawFd for ChannelFd {
    fn as_raw_fd(&self) -> c_int {
        self.0
    }
}

/// Register a completion channel's fd with the current tokio reactor.
///
/// # Safety
/// `fd` must be the fd of a live completion channel that is destroyed only after the
/// returned `AsyncFd` has been dropped.
pub unsafe fn register_channel_fd(
    fd: c_int,
) -> std::io::Result<tokio::io::unix::AsyncFd<ChannelFd>> {
    // SAFETY: the caller keeps the channel (and so its fd) open for the AsyncFd's life, and
    // ChannelFd always returns that same fd.
    unsafe {
        tokio::io::unix::AsyncFd::register_with_interest(
            ChannelFd(fd),
            tokio::io::Interest::READABLE,
        )
    }
    .map_err(|e| e.into_parts().1)
}

/// Make `fd` non-blocking (`fcntl(F_SETFL, O_NONBLOCK)`).
pub fn set_nonblocking(fd: c_int) -> std::io::Result<()> {
    // SAFETY: fcntl on an fd we own (the completion channel's); no memory is passed.
    let fl = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if fl < 0 {
        return Err(errno());
    }
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK) } < 0 {
        return Err(errno());
    }
    Ok(())
}
