//! Element types, reduction operators, the deterministic inputs every rank can recompute,
//! and the step plans of the ring collectives.

use std::ops::Range;

/// Element type (nccl-tests `-d`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DataType {
    /// IEEE 754 binary32, little-endian (`ncclFloat32`).
    #[value(name = "float", alias = "f32", alias = "float32")]
    Float,
    /// bfloat16: the upper 16 bits of a binary32, little-endian (`ncclBfloat16`).
    #[value(name = "bfloat16", alias = "bf16")]
    Bfloat16,
}

impl DataType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DataType::Float => 4,
            DataType::Bfloat16 => 2,
        }
    }

    /// The name nccl-tests prints in the `type` column.
    pub fn name(self) -> &'static str {
        match self {
            DataType::Float => "float",
            DataType::Bfloat16 => "bfloat16",
        }
    }

    /// Decode element `i` of `b`.
    pub fn get(self, b: &[u8], i: usize) -> f32 {
        match self {
            DataType::Float => f32::from_le_bytes(b[4 * i..4 * i + 4].try_into().unwrap_or([0; 4])),
            DataType::Bfloat16 => {
                f32::from_bits(u32::from(u16::from_le_bytes([b[2 * i], b[2 * i + 1]])) << 16)
            }
        }
    }

    /// Encode `v` as element `i` of `b` (bfloat16: round to nearest, ties to even).
    pub fn put(self, b: &mut [u8], i: usize, v: f32) {
        match self {
            DataType::Float => b[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes()),
            DataType::Bfloat16 => {
                b[2 * i..2 * i + 2].copy_from_slice(&f32_to_bf16(v).to_le_bytes())
            }
        }
    }
}

/// binary32 to bfloat16, round to nearest even (NaN stays a quiet NaN).
pub fn f32_to_bf16(v: f32) -> u16 {
    let bits = v.to_bits();
    if v.is_nan() {
        return ((bits >> 16) | 0x40) as u16;
    }
    let round = 0x7fff + ((bits >> 16) & 1);
    (bits.wrapping_add(round) >> 16) as u16
}

/// Reduction operator (nccl-tests `-o`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum RedOp {
    /// `ncclSum`.
    Sum,
    /// `ncclMax`.
    Max,
    /// `ncclMin`.
    Min,
}

impl RedOp {
    pub fn name(self) -> &'static str {
        match self {
            RedOp::Sum => "sum",
            RedOp::Max => "max",
            RedOp::Min => "min",
        }
    }

    pub fn apply(self, a: f32, b: f32) -> f32 {
        match self {
            RedOp::Sum => a + b,
            RedOp::Max => a.max(b),
            RedOp::Min => a.min(b),
        }
    }
}

/// `acc[i] = op(acc[i], src[i])` element-wise over two equally long byte slices.
pub fn reduce_into(dt: DataType, op: RedOp, acc: &mut [u8], src: &[u8]) {
    match dt {
        DataType::Float => {
            for (a, s) in acc.chunks_exact_mut(4).zip(src.chunks_exact(4)) {
                let x = f32::from_le_bytes([a[0], a[1], a[2], a[3]]);
                let y = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
                a.copy_from_slice(&op.apply(x, y).to_le_bytes());
            }
        }
        DataType::Bfloat16 => {
            for (a, s) in acc.chunks_exact_mut(2).zip(src.chunks_exact(2)) {
                let x = f32::from_bits(u32::from(u16::from_le_bytes([a[0], a[1]])) << 16);
                let y = f32::from_bits(u32::from(u16::from_le_bytes([s[0], s[1]])) << 16);
                a.copy_from_slice(&f32_to_bf16(op.apply(x, y)).to_le_bytes());
            }
        }
    }
}

/// Element `i` of rank `r`'s input: a small integer in -8..=8, so that every partial sum of
/// up to 16 ranks is exact in bfloat16 and in any order of summation, and the check can
/// compare bit for bit.
pub fn input_value(r: usize, i: usize) -> f32 {
    ((r.wrapping_mul(7) + i.wrapping_mul(13) + 3) % 17) as f32 - 8.0
}

/// Rank `r`'s input buffer of `count` elements.
pub fn input(dt: DataType, r: usize, count: usize) -> Vec<u8> {
    let mut b = vec![0u8; count * dt.size()];
    for i in 0..count {
        dt.put(&mut b, i, input_value(r, i));
    }
    b
}

/// The collective (nccl-tests has one binary per collective; here `--collective`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Collective {
    /// Ring all-reduce: reduce-scatter, then all-gather.
    #[value(name = "all_reduce", alias = "allreduce")]
    AllReduce,
    /// Ring all-gather: every rank ends with every rank's block.
    #[value(name = "all_gather", alias = "allgather")]
    AllGather,
    /// Ring reduce-scatter: rank r ends with the reduction of block r.
    #[value(name = "reduce_scatter", alias = "reducescatter")]
    ReduceScatter,
    /// All-to-all (MoE dispatch): block j of rank r goes to rank j, at offset r.
    #[value(name = "alltoall", alias = "all_to_all")]
    AllToAll,
}

impl Collective {
    pub fn name(self) -> &'static str {
        match self {
            Collective::AllReduce => "all_reduce",
            Collective::AllGather => "all_gather",
            Collective::ReduceScatter => "reduce_scatter",
            Collective::AllToAll => "alltoall",
        }
    }

    /// nccl-tests' bus bandwidth factor (PERFORMANCE.md): `2(n-1)/n` for all-reduce,
    /// `(n-1)/n` for all-gather, reduce-scatter and all-to-all.
    pub fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Collective::AllReduce => 2.0 * (n - 1.0) / n,
            _ => (n - 1.0) / n,
        }
    }

    /// Whether the `redop` column applies.
    pub fn reduces(self) -> bool {
        matches!(self, Collective::AllReduce | Collective::ReduceScatter)
    }
}

/// The buffers of a rank. `Stage` and `Output` are the ones peers write into.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Buf {
    /// The rank's input (never written after set-up).
    Input,
    /// The reduce-scatter accumulator (local).
    Work,
    /// Where the previous rank's partial sums land (remote-writable).
    Stage,
    /// The result (remote-writable).
    Output,
}

/// One transfer: `len` bytes of local `src` at `off` into peer's `dst` at `dst_off`, with
/// the immediate `imm` as the ready signal.
#[derive(Clone, Debug)]
pub struct Send {
    pub peer: usize,
    pub src: Buf,
    pub off: usize,
    pub dst: Buf,
    pub dst_off: usize,
    pub len: usize,
    pub imm: u32,
}

/// One expected arrival from `peer`: `len` bytes into local `dst` at `off`, signalled by `imm`.
#[derive(Clone, Debug)]
pub struct Recv {
    pub peer: usize,
    pub dst: Buf,
    pub off: usize,
    pub len: usize,
    pub imm: u32,
}

/// Local work between transfers.
#[derive(Clone, Debug)]
pub enum Local {
    /// Copy `src[range]` to `dst` at offset `dst_off`.
    Copy {
        src: Buf,
        range: Range<usize>,
        dst: Buf,
        dst_off: usize,
    },
    /// `Work[range] = op(Work[range], Stage[range])`.
    Reduce(Range<usize>),
}

/// One step: all sends and receives run concurrently; then the local work.
#[derive(Clone, Debug, Default)]
pub struct Step {
    pub sends: Vec<Send>,
    pub recvs: Vec<Recv>,
    pub after: Vec<Local>,
}

/// A copy to the same offset.
fn copy(src: Buf, range: Range<usize>, dst: Buf) -> Local {
    let dst_off = range.start;
    Local::Copy {
        src,
        range,
        dst,
        dst_off,
    }
}

/// The immediate of step `step` of phase `phase` carrying block `block`.
pub fn imm(phase: u32, step: usize, block: usize) -> u32 {
    (phase << 28) | ((step as u32 & 0xfff) << 16) | (block as u32 & 0xffff)
}

/// Byte range of block `c` of `n` over `count` elements (blocks differ by at most one).
fn block(c: usize, n: usize, count: usize, es: usize) -> Range<usize> {
    (c * count / n) * es..((c + 1) * count / n) * es
}

/// Element count of a run of `size` bytes: rounded down so that every rank's block holds
/// the same whole number of elements (all-gather, reduce-scatter, all-to-all) or at least
/// one element (all-reduce).
pub fn count_for(coll: Collective, dt: DataType, n: usize, size: usize) -> usize {
    let c = size / dt.size();
    match coll {
        Collective::AllReduce => c,
        _ => c / n * n,
    }
}

/// The steps rank `r` of `n` runs for one collective over `count` elements (of the whole
/// buffer: the all-reduce vector, the all-gather output, the reduce-scatter input, the
/// all-to-all send buffer). Ring order: rank r sends to r+1 and receives from r-1.
pub fn plan(coll: Collective, dt: DataType, r: usize, n: usize, count: usize) -> Vec<Step> {
    let es = dt.size();
    let next = (r + 1) % n;
    let prev = (r + n - 1) % n;
    let m = |k: isize| (k.rem_euclid(n as isize)) as usize;
    let ri = r as isize;
    let blk = |c: usize| block(c, n, count, es);
    // Ring step `s` of `phase`: block `sb` of `src` goes to `next`'s `dst` at the same
    // offset while block `rb` arrives from `prev` into this rank's `dst`.
    let ring_step = |src: Buf, dst: Buf, phase: u32, s: usize, sb: usize, rb: usize| {
        let (so, ro) = (blk(sb), blk(rb));
        Step {
            sends: vec![Send {
                peer: next,
                src,
                off: so.start,
                dst,
                dst_off: so.start,
                len: so.len(),
                imm: imm(phase, s, sb),
            }],
            recvs: vec![Recv {
                peer: prev,
                dst,
                off: ro.start,
                len: ro.len(),
                imm: imm(phase, s, rb),
            }],
            after: vec![],
        }
    };
    let mut steps = Vec::new();
    match coll {
        Collective::AllReduce | Collective::ReduceScatter => {
            // Reduce-scatter. All-reduce: at step s send block r-s, receive block r-s-1,
            // so rank r ends owning block r+1. Reduce-scatter: shifted by one, so rank r
            // ends owning block r (at offset 0 of its output).
            let shift: isize = if coll == Collective::AllReduce { 0 } else { -1 };
            let mut pre = Step::default();
            pre.after.push(copy(Buf::Input, 0..count * es, Buf::Work));
            steps.push(pre);
            for s in 0..n - 1 {
                let sb = m(ri + shift - s as isize);
                let rb = m(ri + shift - s as isize - 1);
                let mut step = ring_step(Buf::Work, Buf::Stage, 1, s, sb, rb);
                step.after.push(Local::Reduce(blk(rb)));
                steps.push(step);
            }
            if coll == Collective::ReduceScatter {
                let own = blk(r);
                let mut fin = Step::default();
                // The result buffer holds only this rank's block: copy it to offset 0.
                fin.after.push(Local::Copy {
                    src: Buf::Work,
                    range: own,
                    dst: Buf::Output,
                    dst_off: 0,
                });
                steps.push(fin);
                return steps;
            }
            let own = blk(m(ri + 1));
            let mut fin = Step::default();
            fin.after.push(copy(Buf::Work, own, Buf::Output));
            steps.push(fin);
            // All-gather of the reduced blocks: at step s send block r+1-s, receive r-s.
            for s in 0..n - 1 {
                let sb = m(ri + 1 - s as isize);
                let rb = m(ri - s as isize);
                steps.push(ring_step(Buf::Output, Buf::Output, 2, s, sb, rb));
            }
        }
        Collective::AllGather => {
            // Input: count/n elements; output: count. Step s: send block r-s, receive r-s-1.
            let own = blk(r);
            let mut pre = Step::default();
            pre.after.push(copy(Buf::Input, own, Buf::Output));
            steps.push(pre);
            for s in 0..n - 1 {
                let sb = m(ri - s as isize);
                let rb = m(ri - s as isize - 1);
                steps.push(ring_step(Buf::Output, Buf::Output, 3, s, sb, rb));
            }
        }
        Collective::AllToAll => {
            // One step: block j of the input goes to rank j's output block r, all at once.
            let mut st = Step::default();
            st.after.push(copy(Buf::Input, blk(r), Buf::Output));
            for j in (0..n).filter(|&j| j != r) {
                let (out, inb) = (blk(j), blk(r));
                st.sends.push(Send {
                    peer: j,
                    src: Buf::Input,
                    off: out.start,
                    dst: Buf::Output,
                    dst_off: inb.start,
                    len: out.len(),
                    imm: imm(4, 0, r),
                });
                let from = blk(j);
                st.recvs.push(Recv {
                    peer: j,
                    dst: Buf::Output,
                    off: from.start,
                    len: from.len(),
                    imm: imm(4, 0, j),
                });
            }
            steps.push(st);
        }
    }
    steps
}

/// The input rank `r` starts from (what its `Input` buffer holds for `count` elements).
pub fn input_for(coll: Collective, dt: DataType, r: usize, n: usize, count: usize) -> Vec<u8> {
    match coll {
        Collective::AllGather => {
            // Only block r of the gathered vector: element i of it is rank r's element i.
            let blk = count / n;
            let mut b = vec![0u8; count * dt.size()];
            for i in 0..blk {
                dt.put(&mut b, r * blk + i, input_value(r, i));
            }
            b
        }
        _ => input(dt, r, count),
    }
}

/// Elements of rank `r`'s output that differ from the locally computed result.
pub fn wrong(
    coll: Collective,
    dt: DataType,
    op: RedOp,
    r: usize,
    n: usize,
    count: usize,
    out: &[u8],
) -> u64 {
    let q = |v: f32| {
        dt.get(
            &{
                let mut b = [0u8; 4];
                dt.put(&mut b, 0, v);
                b
            },
            0,
        )
    };
    let reduced = |i: usize| {
        let mut acc = q(input_value(0, i));
        for k in 1..n {
            acc = q(op.apply(acc, q(input_value(k, i))));
        }
        acc
    };
    let blk = count / n;
    let (len, f): (usize, Box<dyn Fn(usize) -> f32>) = match coll {
        Collective::AllReduce => (count, Box::new(reduced)),
        Collective::ReduceScatter => (blk, Box::new(move |i| reduced(r * blk + i))),
        Collective::AllGather => (count, Box::new(move |i| q(input_value(i / blk, i % blk)))),
        Collective::AllToAll => (
            count,
            Box::new(move |i| q(input_value(i / blk, r * blk + i % blk))),
        ),
    };
    (0..len)
        .filter(|&i| dt.get(out, i).to_bits() != f(i).to_bits())
        .count() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Run the plans of all `n` ranks in memory, step by step in lock-step (a send is a
    /// copy into the peer's buffer), and return every rank's output.
    #[allow(clippy::needless_range_loop)] // step k of every rank's plan, side by side
    fn simulate(coll: Collective, dt: DataType, op: RedOp, n: usize, count: usize) -> Vec<Vec<u8>> {
        let len = count * dt.size();
        let mut bufs: Vec<[Vec<u8>; 4]> = (0..n)
            .map(|r| {
                [
                    input_for(coll, dt, r, n, count),
                    vec![0; len],
                    vec![0xee; len],
                    vec![0xff; len],
                ]
            })
            .collect();
        let i = |b: Buf| b as usize;
        let plans: Vec<Vec<Step>> = (0..n).map(|r| plan(coll, dt, r, n, count)).collect();
        let steps = plans[0].len();
        assert!(plans.iter().all(|p| p.len() == steps));
        for k in 0..steps {
            for r in 0..n {
                for s in &plans[r][k].sends {
                    // The receiver expects exactly this transfer in the same step.
                    let rv = plans[s.peer][k]
                        .recvs
                        .iter()
                        .find(|rv| rv.peer == r)
                        .expect("matching receive");
                    assert_eq!(
                        (rv.dst, rv.off, rv.len, rv.imm),
                        (s.dst, s.dst_off, s.len, s.imm)
                    );
                    let data = bufs[r][i(s.src)][s.off..s.off + s.len].to_vec();
                    bufs[s.peer][i(s.dst)][s.dst_off..s.dst_off + s.len].copy_from_slice(&data);
                }
            }
            for r in 0..n {
                for l in &plans[r][k].after {
                    match l {
                        Local::Copy {
                            src,
                            range,
                            dst,
                            dst_off,
                        } => {
                            let d = bufs[r][i(*src)][range.clone()].to_vec();
                            bufs[r][i(*dst)][*dst_off..*dst_off + d.len()].copy_from_slice(&d);
                        }
                        Local::Reduce(range) => {
                            let st = bufs[r][i(Buf::Stage)][range.clone()].to_vec();
                            reduce_into(dt, op, &mut bufs[r][i(Buf::Work)][range.clone()], &st);
                        }
                    }
                }
            }
        }
        bufs.into_iter().map(|[_, _, _, o]| o).collect()
    }

    /// Every plan computes what the check computes locally, for 2..=7 ranks, counts that
    /// do not divide evenly (all-reduce), both element types and every operator; and the
    /// check notices a single wrong element.
    #[test]
    fn plans_compute_the_collective_and_the_check_sees_one_wrong_element() {
        let colls = [
            Collective::AllReduce,
            Collective::AllGather,
            Collective::ReduceScatter,
            Collective::AllToAll,
        ];
        for coll in colls {
            for dt in [DataType::Float, DataType::Bfloat16] {
                for op in [RedOp::Sum, RedOp::Max, RedOp::Min] {
                    for n in 2..=7 {
                        for size in [n * 4, 1000, 4096 + 12] {
                            let count = count_for(coll, dt, n, size);
                            let outs = simulate(coll, dt, op, n, count);
                            for (r, o) in outs.iter().enumerate() {
                                let w = wrong(coll, dt, op, r, n, count, o);
                                assert_eq!(
                                    w, 0,
                                    "{coll:?} {dt:?} {op:?} n={n} count={count} rank {r}"
                                );
                            }
                            let mut bad = outs[n - 1].clone();
                            bad[0] ^= 0x40;
                            assert_eq!(wrong(coll, dt, op, n - 1, n, count, &bad), 1);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn bus_factors_are_nccl_tests() {
        assert_eq!(Collective::AllReduce.bus_factor(4), 1.5);
        assert_eq!(Collective::AllGather.bus_factor(4), 0.75);
        assert_eq!(Collective::ReduceScatter.bus_factor(8), 0.875);
        assert_eq!(Collective::AllToAll.bus_factor(2), 0.5);
    }

    #[test]
    fn bf16_rounds_to_nearest_even() {
        assert_eq!(f32_to_bf16(1.0), 0x3f80);
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1.0).
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8000)), 0x3f80);
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f81_8000)), 0x3f82);
    }
}
