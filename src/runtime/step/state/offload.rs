//! A rank's shard state on the NVMe tier: writing it there when the state is built, streaming it
//! through the staging buffers for the optimizer step, and reading single chunks (for resharding,
//! backups and checkpoints) or a unit's parameter shard (for stage 3's gather) back.
//!
//! The optimizer streams record by record: while record `k` is updated, the next records are
//! being read (up to the staging buffers the plan sized) and the previous ones written back, so
//! the disk and the update overlap and RAM holds a fixed number of records whatever the model's
//! size. The update is elementwise, so cutting it at record boundaries changes no bits.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::Arc;

use crate::model::backend::Backend;
use crate::model::Model;
use crate::optim::OptimSettings;
use crate::reduce::grad_buf;
use crate::runtime::storage::tier_file::Pending;
use crate::runtime::storage::{AlignedBuf, RecordKinds, TierError, TierFile};

use crate::runtime::step::state::full_copy::FullCopy;

/// The pieces of shard elements `span` as (shard range, unit range) pairs, given the shard's
/// chunk ranges within the unit (the shard is those ranges concatenated).
pub fn shard_pieces(
    ranges: &[Range<usize>],
    span: Range<usize>,
) -> Vec<(Range<usize>, Range<usize>)> {
    let mut out = Vec::new();
    let mut off = 0;
    for r in ranges {
        let (s, e) = (off, off + r.len());
        let (a, b) = (span.start.max(s), span.end.min(e));
        if a < b {
            out.push((a..b, r.start + (a - s)..r.start + (b - s)));
        }
        off = e;
        if off >= span.end {
            break;
        }
    }
    out
}

/// Writes unit `u`'s shard state from RAM into its records, keeping the writes in flight up to
/// the staging buffers.
pub fn spill_unit(
    tier: &mut TierFile,
    u: usize,
    params: &[f32],
    m: &[f32],
    v: &[f32],
) -> Result<(), TierError> {
    let kinds = tier.layout.kinds;
    let mut writes: VecDeque<Pending> = VecDeque::new();
    for rec in tier.layout.unit_records(u) {
        let tile = tier.layout.record_tile(rec);
        let mut buf = next_buf(tier, &mut writes)?;
        let (_, span) = tier.layout.record_span(rec);
        let n = span.len();
        let vals = buf.f32s_mut();
        let mut k = 0;
        if kinds.params {
            vals[..n].copy_from_slice(&params[span.clone()]);
            k += 1;
        }
        for s in [m, v].into_iter().take(kinds.state) {
            vals[k * tile..k * tile + n].copy_from_slice(&s[span.clone()]);
            k += 1;
        }
        writes.push_back(tier.start_write(rec, buf)?);
    }
    drain(tier, writes)
}

/// A free staging buffer, finishing the oldest of `writes` if none is free, and only then
/// taking one from a read ahead (which would be read again).
fn next_buf(tier: &mut TierFile, writes: &mut VecDeque<Pending>) -> Result<AlignedBuf, TierError> {
    loop {
        if let Some(b) = tier.take_free_buf() {
            return Ok(b);
        }
        let Some(oldest) = writes.pop_front() else {
            return Ok(tier
                .take_buf()
                .expect("a staging buffer is free, in a write or in a read ahead"));
        };
        let b = tier.finish(oldest)?;
        tier.put_buf(b);
    }
}

fn drain(tier: &mut TierFile, writes: VecDeque<Pending>) -> Result<(), TierError> {
    let mut first_err = None;
    for p in writes {
        match tier.finish(p) {
            Ok(b) => tier.put_buf(b),
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    first_err.map_or(Ok(()), Err)
}

/// What the optimizer step needs besides the tier: the backend that runs it, the settings and
/// the step's scalars.
pub struct StepArgs<'a> {
    pub be: &'a dyn Backend,
    pub settings: OptimSettings,
    /// The fp32 masters are the shard's (in RAM or the tier's parameter column), not the full
    /// copy's.
    pub masters_in_shard: bool,
    pub t: u64,
    pub lr: f32,
    /// The unit's gradient shard as f32, the mean clipped (empty when the gradients are on
    /// the tier).
    pub g: &'a [f32],
    /// The clip coefficient, for a mean gradient read off the tier (`grad_buf::apply_clip`).
    pub clip_coef: f64,
    /// Write the update into the unit's other copy (`TierFile::start_write_next`), not over
    /// its state.
    pub next_copy: bool,
}

/// The scalars of one step's update: Adam's t, the learning rate and the clip coefficient.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepScalars {
    pub t: u64,
    pub lr: f32,
    pub clip_coef: f64,
}

/// Updates units whose whole shard state (masters, m and v) is on the tier, one at a time, for
/// the step's updates that run outside the optimizer phase: owed to the next forward
/// (`owed.rs`) or run in the backward (`tier_io.rs`).
pub struct TierUpdater {
    model: Arc<dyn Model>,
    settings: OptimSettings,
    /// Each unit's shard chunk ranges within the unit.
    ranges: Vec<Vec<Range<usize>>>,
    /// Updates in the backward take the parameter shard its gather read
    /// ([`TierUpdater::reusing_params`]).
    reuses_params: bool,
}

impl TierUpdater {
    pub fn new(
        model: Arc<dyn Model>,
        settings: OptimSettings,
        ranges: Vec<Vec<Range<usize>>>,
    ) -> Self {
        Self {
            model,
            settings,
            ranges,
            reuses_params: false,
        }
    }

    /// With `yes`, the step keeps the parameter shard each unit's backward gather read and
    /// hands it to the unit's update in the backward, which then reads only m and v.
    pub fn reusing_params(self, yes: bool) -> Self {
        Self {
            reuses_params: yes,
            ..self
        }
    }

    pub fn reuses_params(&self) -> bool {
        self.reuses_params
    }

    pub fn units(&self) -> usize {
        self.ranges.len()
    }

    pub fn settings(&self) -> OptimSettings {
        self.settings
    }

    /// Streams unit `u`'s records through the update with `step`'s scalars. `g` is the unit's
    /// mean gradient shard, or empty where the records hold it; `params_in` the shard's
    /// parameters as the tier holds them (not read again), or empty; the updated masters also
    /// land in `params_out` (the shard's length, or empty); with `next_copy` the update goes
    /// to the unit's other copy.
    #[allow(clippy::too_many_arguments)]
    pub fn update(
        &self,
        tier: &mut TierFile,
        stream: &mut UpdateStream,
        u: usize,
        step: StepScalars,
        (g, params_in): (&[f32], &[f32]),
        params_out: &mut [f32],
        next_copy: bool,
    ) -> Result<(), TierError> {
        let args = StepArgs {
            be: self.model.backend(),
            settings: self.settings,
            masters_in_shard: true,
            t: step.t,
            lr: step.lr,
            g,
            clip_coef: step.clip_coef,
            next_copy,
        };
        let parts = ShardParts {
            ranges: &self.ranges[u],
            params: &mut [],
            m: &mut [],
            v: &mut [],
            params_in,
            params_out,
        };
        update_unit(tier, stream, u, parts, &mut FullCopy::default(), &args)
    }

    /// Runs unit `u`'s update in the backward, from its mean gradient shard `g` (clipping is
    /// off) and its parameter shard `params` if the step kept it (else read), into the unit's
    /// other copy, and stages it: it becomes the unit's state when the step is agreed. Reads go
    /// no further ahead than the unit's own records.
    pub fn update_into_next(
        &self,
        tier: &mut TierFile,
        u: usize,
        t: u64,
        lr: f32,
        g: &[f32],
        params: &[f32],
    ) -> Result<(), TierError> {
        let step = StepScalars {
            t,
            lr,
            clip_coef: 1.0,
        };
        let mut stream = UpdateStream::until(tier.layout.unit_records(u).end);
        let res = self.update(tier, &mut stream, u, step, (g, params), &mut [], true);
        res.and(stream.finish(tier))?;
        tier.stage_next(u);
        Ok(())
    }
}

/// The parts of a unit's shard that stay in RAM (empty where they are on the tier).
pub struct ShardParts<'a> {
    /// The shard's chunk ranges within the unit.
    pub ranges: &'a [Range<usize>],
    pub params: &'a mut [f32],
    pub m: &'a mut [f32],
    pub v: &'a mut [f32],
    /// The shard's parameters as the records hold them, which are then not read (empty for
    /// none): an update in the backward takes the shard its gather read.
    pub params_in: &'a [f32],
    /// Where the updated masters are copied as well, in shard order (empty for none): an
    /// update owed to the next forward hands the gather its shard without reading it again.
    pub params_out: &'a mut [f32],
}

/// The optimizer step's I/O over all units: reads run ahead across unit boundaries, in record
/// order, while a staging buffer is free, and a write is waited for only when its buffer is
/// needed; [`UpdateStream::finish`] hands the last ones to the tier file. Units are updated in ascending order (records are laid
/// out unit after unit), so the next unit's first records arrive while this one's last ones
/// are updated, and a small unit costs no disk round trip of its own.
#[derive(Default)]
pub struct UpdateStream {
    reads: VecDeque<(usize, Pending)>,
    writes: VecDeque<Pending>,
    /// The next record to read.
    next: usize,
    /// No record from here on is read ahead (`None`: up to the file's end).
    end: Option<usize>,
}

impl UpdateStream {
    /// A stream that reads no further ahead than record `end` (exclusive): for updating some
    /// units and not the ones after them.
    pub fn until(end: usize) -> Self {
        Self {
            end: Some(end),
            ..Self::default()
        }
    }

    /// Ends the phase: waits for the reads still in flight (after a failure) and leaves the
    /// writes in flight with the tier file ([`TierFile::defer`]), so the write-back overlaps
    /// the next step's compute; whatever reads the tier next waits for them. The first read
    /// error, if any.
    pub fn finish(self, tier: &mut TierFile) -> Result<(), TierError> {
        let mut first_err = None;
        for (_, p) in self.reads {
            match tier.finish(p) {
                Ok(b) => tier.put_buf(b),
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        self.writes.into_iter().for_each(|p| tier.defer(p));
        first_err.map_or(Ok(()), Err)
    }
}

/// Streams unit `u`'s records through the optimizer: read (ahead), update, write back. A
/// gradient on the tier is read with the record and not written back. A full copy beside
/// masters in the shard (bf16 at stages 0-2) is refreshed from the updated masters. Reads and
/// writes stay in flight in `stream` for the next unit; [`UpdateStream::finish`] ends them.
pub fn update_unit(
    tier: &mut TierFile,
    stream: &mut UpdateStream,
    u: usize,
    mut shard: ShardParts<'_>,
    full: &mut FullCopy,
    a: &StepArgs<'_>,
) -> Result<(), TierError> {
    let kinds = tier.layout.kinds;
    let values = kinds.values();
    let records = tier.layout.unit_records(u);
    let total = stream
        .end
        .map_or(tier.layout.records(), |e| e.min(tier.layout.records()));
    debug_assert!(records.end <= total, "unit {u} is past the stream's end");
    stream.next = stream.next.max(records.start);
    // The parameters at hand are not read: the read takes the values after them, and they are
    // put in front once it lands.
    let given = kinds.params && !shard.params_in.is_empty();
    debug_assert!(!given || shard.params_in.len() == tier.layout.unit_lens[u]);
    let read = usize::from(given)..values;
    let mut g_tile = if kinds.grads > 0 {
        vec![0f32; tier.layout.tile_elems]
    } else {
        Vec::new()
    };
    for rec in records.clone() {
        let mut buf = stream.next_record(tier, rec, total, &read)?;
        let (_, span) = tier.layout.record_span(rec);
        let tile = tier.layout.record_tile(rec);
        if given {
            let vals = buf.f32s_mut();
            vals.copy_within(0..tile * read.len(), tile);
            vals[..span.len()].copy_from_slice(&shard.params_in[span.clone()]);
            vals[span.len()..tile].fill(0.0);
        }
        let (head, gcols) = buf.f32s_mut().split_at_mut(tile * kinds.grads_at());
        if kinds.grads > 0 {
            let g = &mut g_tile[..span.len()];
            g.copy_from_slice(&gcols[..span.len()]);
            grad_buf::apply_clip(g, a.clip_coef);
        }
        update_record(head, kinds, (tile, span), &mut shard, full, a, &g_tile);
        stream.write_back(tier, rec, buf, kinds.grads_at(), a.next_copy)?;
    }
    Ok(())
}

impl UpdateStream {
    /// Record `rec`'s values (`read` of them), once its read lands; reads ahead first, while
    /// a buffer is free (into the next units too), keeping one for the write-back pipeline.
    fn next_record(
        &mut self,
        tier: &mut TierFile,
        rec: usize,
        total: usize,
        read: &Range<usize>,
    ) -> Result<AlignedBuf, TierError> {
        while self.next < total && (self.next == rec || tier_has_spare(tier)) {
            let buf = next_buf(tier, &mut self.writes)?;
            let pending = tier.start_read(self.next, read.clone(), buf)?;
            self.reads.push_back((self.next, pending));
            self.next += 1;
        }
        let (r, pending) = self
            .reads
            .pop_front()
            .expect("the current record was started");
        debug_assert_eq!(r, rec);
        tier.finish(pending)
    }

    /// Starts writing record `rec`'s first `own` values back (the updated state; a gradient
    /// after them is not written), into the unit's other copy with `next_copy`.
    fn write_back(
        &mut self,
        tier: &mut TierFile,
        rec: usize,
        buf: AlignedBuf,
        own: usize,
        next_copy: bool,
    ) -> Result<(), TierError> {
        let own = 0..own;
        if own.is_empty() {
            tier.put_buf(buf);
        } else if next_copy {
            self.writes.push_back(tier.start_write_next(rec, own, buf)?);
        } else {
            self.writes
                .push_back(tier.start_write_values(rec, own, buf)?);
        }
        Ok(())
    }
}

/// The optimizer over one record's pieces of the shard: `head` holds the record's state
/// columns (each `tile` wide) where the tier holds them, the rest is in RAM; `g_tile` its
/// clipped gradient where the tier holds the gradients.
fn update_record(
    head: &mut [f32],
    kinds: RecordKinds,
    (tile, span): (usize, Range<usize>),
    shard: &mut ShardParts<'_>,
    full: &mut FullCopy,
    a: &StepArgs<'_>,
    g_tile: &[f32],
) {
    let mut cols = head.chunks_mut(tile);
    let mut tp = if kinds.params { cols.next() } else { None };
    let mut tm = (kinds.state >= 1).then(|| cols.next()).flatten();
    let mut tv = (kinds.state >= 2).then(|| cols.next()).flatten();
    for (sr, ur) in shard_pieces(shard.ranges, span.clone()) {
        let (lo, n) = (sr.start - span.start, sr.len());
        let m: &mut [f32] = match tm.as_deref_mut() {
            Some(c) => &mut c[lo..lo + n],
            None => ram_state(shard.m, sr.clone()),
        };
        let v: &mut [f32] = match tv.as_deref_mut() {
            Some(c) => &mut c[lo..lo + n],
            None => ram_state(shard.v, sr.clone()),
        };
        let g = if kinds.grads > 0 {
            &g_tile[lo..lo + n]
        } else {
            &a.g[sr.clone()]
        };
        let mut step = |p: &mut [f32]| a.be.optimizer_update(&a.settings, p, g, m, v, a.t, a.lr);
        let p: &mut [f32] = match tp.as_deref_mut() {
            Some(c) => &mut c[lo..lo + n],
            None if a.masters_in_shard => &mut shard.params[sr.clone()],
            None => {
                let p = full
                    .f32s_mut()
                    .expect("a full copy without masters beside it is fp32");
                step(&mut p[ur]);
                continue;
            }
        };
        step(p);
        if !shard.params_out.is_empty() {
            shard.params_out[sr].copy_from_slice(p);
        }
        if !full.is_empty() {
            full.set_from_masters(ur, p);
        }
    }
}

/// Writes unit `u`'s mean gradient shard (`g`, the shard's length, before clipping) into the
/// gradient column of its records.
pub fn spill_grads(tier: &mut TierFile, u: usize, g: &[f32]) -> Result<(), TierError> {
    let kinds = tier.layout.kinds;
    let cols = kinds.grads_at()..kinds.values();
    let mut writes: VecDeque<Pending> = VecDeque::new();
    for rec in tier.layout.unit_records(u) {
        let mut buf = next_buf(tier, &mut writes)?;
        let (_, span) = tier.layout.record_span(rec);
        buf.f32s_mut()[..span.len()].copy_from_slice(&g[span]);
        writes.push_back(tier.start_write_values(rec, cols.clone(), buf)?);
    }
    drain(tier, writes)
}

fn tier_has_spare(tier: &TierFile) -> bool {
    // A read ahead's buffer is not spare: it holds a record the stream reads later.
    tier.free_bufs() - tier.reads_ahead() > 1
}

fn ram_state(v: &mut [f32], r: Range<usize>) -> &mut [f32] {
    if v.is_empty() {
        v
    } else {
        &mut v[r]
    }
}

/// Reads value `k` of shard elements `elems` of unit `u`, which may span records: the records'
/// value `k`, as many in flight as there are free staging buffers (one at a time would wait a
/// disk round trip per record). Every read started is waited for, also after a failure, so
/// every buffer returns to the pool.
pub fn read_shard_values(
    tier: &mut TierFile,
    u: usize,
    k: usize,
    elems: Range<usize>,
) -> Result<Vec<f32>, TierError> {
    let mut out = vec![0f32; elems.len()];
    let mut reads: VecDeque<(usize, Pending)> = VecDeque::new();
    let mut first_err = None;
    let wanted = tier.layout.unit_records(u).filter(|&rec| {
        let (_, span) = tier.layout.record_span(rec);
        span.start < elems.end && elems.start < span.end
    });
    let wanted: Vec<usize> = wanted.collect();
    for rec in wanted {
        if tier.free_bufs() == 0 {
            let (r, p) = reads.pop_front().expect("buffers are free or reading");
            if let Err(e) = copy_values(tier, r, p, &elems, &mut out) {
                first_err.get_or_insert(e);
            }
        }
        if first_err.is_some() {
            break;
        }
        let buf = tier.take_buf().expect("a buffer is free");
        match tier.start_read(rec, k..k + 1, buf) {
            Ok(p) => reads.push_back((rec, p)),
            Err(e) => {
                first_err.get_or_insert(e);
                break;
            }
        }
    }
    for (r, p) in reads {
        if let Err(e) = copy_values(tier, r, p, &elems, &mut out) {
            first_err.get_or_insert(e);
        }
    }
    first_err.map_or(Ok(out), Err)
}

/// Reads unit `u`'s whole parameter shard (value 0 of every record).
pub fn read_unit_params(tier: &mut TierFile, u: usize, len: usize) -> Result<Vec<f32>, TierError> {
    read_shard_values(tier, u, 0, 0..len)
}

/// Copies the part of record `rec`'s finished read that falls in `elems` into `out` (indexed
/// from `elems.start`).
fn copy_values(
    tier: &mut TierFile,
    rec: usize,
    p: Pending,
    elems: &Range<usize>,
    out: &mut [f32],
) -> Result<(), TierError> {
    let buf = tier.finish(p)?;
    let (_, span) = tier.layout.record_span(rec);
    let (a, b) = (elems.start.max(span.start), elems.end.min(span.end));
    out[a - elems.start..b - elems.start]
        .copy_from_slice(&buf.f32s()[a - span.start..b - span.start]);
    tier.put_buf(buf);
    Ok(())
}
