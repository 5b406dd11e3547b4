//! Splitting a matmul's output columns across threads (the `threads` feature: rayon's global
//! pool, in wasm the workers of `initThreadPool`). Every output value is computed by the same
//! code on the same inputs whichever thread runs it, so the results are bit-identical to one
//! thread. Without the feature, or for small products, the kernel runs once over every column,
//! in place.
//!
//! The calling thread computes a share of the parts itself: in a browser the page's thread may
//! not sleep, so while it waits for the others it spins; working instead, `initThreadPool(1)`
//! already gives two threads of work on two cores. Inside a model's step ([`team`]) the pool's
//! workers wait for the parts in a spin loop; outside one the parts go to rayon's pool
//! (`rayon::in_place_scope`, the page's thread spinning in rayon's `web_spin_lock`). (For the
//! same reason tract-linalg's rayon executor (`multithread-mm`, `RayonGlobal`), which hands each
//! whole product to the pool and spins meanwhile, is not used: fp32 SmolLM2 decoded at 0.6x
//! the one-thread speed with it in Chromium. tract's remaining matmuls (an encoder's products
//! of runtime operands) stay on one thread.)

use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Multiply-accumulates below which a product runs on one thread by default: waking the pool
/// costs more (tens of microseconds in wasm) than it saves.
pub const MIN_PARALLEL_MACS: usize = 1 << 18;

static THRESHOLD: AtomicUsize = AtomicUsize::new(MIN_PARALLEL_MACS);

/// Sets the multiply-accumulates from which a product is split across the threads (default
/// [`MIN_PARALLEL_MACS`]; 0 splits every product, as the tests of the threads build do).
pub fn set_threshold(macs: usize) {
    THRESHOLD.store(macs, Ordering::Relaxed);
}

/// Threads that compute a product: the pool's workers and the calling thread, unless it is one
/// of them (1 without the `threads` feature). In wasm without `initThreadPool`, rayon's global
/// pool is the calling thread alone: 1.
pub fn threads() -> usize {
    #[cfg(feature = "threads")]
    {
        let pool = rayon::current_num_threads();
        if rayon::current_thread_index().is_some() {
            pool
        } else {
            pool + 1
        }
    }
    #[cfg(not(feature = "threads"))]
    {
        1
    }
}

/// Column ranges of `0..n`, one per part, each a multiple of `align` long but the last.
pub fn ranges(n: usize, parts: usize, align: usize) -> Vec<Range<usize>> {
    let units = n.div_ceil(align);
    let parts = parts.clamp(1, units.max(1));
    let per = units.div_ceil(parts) * align;
    (0..n)
        .step_by(per.max(1))
        .map(|s| s..(s + per).min(n))
        .collect()
}

/// Fills `out` (`[rows, n]`, zeroed: f32 sums, or `matmul_integer`'s int32 sums) with
/// `kernel(cols, block)`, where `block` is `[rows, cols.len()]` (zeroed) and receives columns
/// `cols` of the output. The columns are split in
/// `parts` ranges (multiples of `align` columns, so that kernels grouping `align` columns
/// compute each column the same way whatever the split) run in parallel; one part runs the
/// kernel on `out` itself.
pub fn by_columns<T, F>(out: &mut [T], rows: usize, n: usize, align: usize, parts: usize, kernel: F)
where
    T: Copy + Default + Send,
    F: Fn(Range<usize>, &mut [T]) + Sync,
{
    debug_assert_eq!(out.len(), rows * n);
    let ranges = ranges(n, parts, align);
    if ranges.len() <= 1 {
        kernel(0..n, out);
        return;
    }
    run_parts(out, rows, n, &ranges, &kernel);
}

/// The number of parts for a product of `macs` multiply-accumulates: [`threads`], or 1 below
/// the threshold ([`set_threshold`]).
pub fn parts_for(macs: usize) -> usize {
    if macs < THRESHOLD.load(Ordering::Relaxed) {
        1
    } else {
        threads()
    }
}

/// `f` of each range of `ranges(n, parts, align)`, in order: with the `threads` feature the
/// ranges run in parallel (the calling thread runs the first), without it one after the other.
pub fn map_ranges<R, F>(n: usize, parts: usize, align: usize, f: F) -> Vec<R>
where
    R: Send,
    F: Fn(Range<usize>) -> R + Sync,
{
    map_each(&ranges(n, parts, align), f)
}

/// `f` of each of `ranges`, in order, run as [`map_ranges`] says.
fn map_each<R, F>(ranges: &[Range<usize>], f: F) -> Vec<R>
where
    R: Send,
    F: Fn(Range<usize>) -> R + Sync,
{
    #[cfg(feature = "threads")]
    if ranges.len() > 1 {
        use std::sync::Mutex;
        let results: Vec<Mutex<Option<R>>> = ranges.iter().map(|_| Mutex::new(None)).collect();
        for_each_part(ranges.len(), |i| {
            let result = f(ranges[i].clone());
            if let Ok(mut slot) = results[i].lock() {
                *slot = Some(result);
            }
        });
        // Every part has run when `for_each_part` returns: each result is there.
        return results
            .into_iter()
            .filter_map(|r| r.into_inner().ok().flatten())
            .collect();
    }
    ranges.iter().cloned().map(f).collect()
}

/// Runs `kernel` on each of `ranges` (at least two) as [`map_ranges`] does: with the `threads`
/// feature one row's ranges write their pieces of `out` in place; otherwise each range fills a
/// block of its own, then copied into `out` (without the feature, the same split one part after
/// the other, for tests).
fn run_parts<T, F>(out: &mut [T], rows: usize, n: usize, ranges: &[Range<usize>], kernel: &F)
where
    T: Copy + Default + Send,
    F: Fn(Range<usize>, &mut [T]) + Sync,
{
    #[cfg(feature = "threads")]
    if rows == 1 {
        use std::sync::Mutex;
        // One row: each range is a contiguous piece of `out`.
        let mut pieces = Vec::with_capacity(ranges.len());
        let mut rest = out;
        for r in ranges {
            let (piece, tail) = rest.split_at_mut(r.len());
            pieces.push(Mutex::new(Some(piece)));
            rest = tail;
        }
        for_each_part(ranges.len(), |i| {
            if let Some(piece) = pieces[i].lock().ok().and_then(|mut p| p.take()) {
                kernel(ranges[i].clone(), piece);
            }
        });
        return;
    }
    let blocks = map_each(ranges, |cols| {
        let mut block = vec![T::default(); rows * cols.len()];
        kernel(cols, &mut block);
        block
    });
    place(out, n, ranges, &blocks);
}

/// Runs `part(0..parts)` across the threads, the calling thread taking its share, and returns
/// when every part has run: on the spinning members of a [`team`] when the calling thread leads
/// one, else on rayon's pool (whose workers sleep between products; the calling thread runs
/// part 0).
#[cfg(feature = "threads")]
fn for_each_part<F: Fn(usize) + Sync>(parts: usize, part: F) {
    match team::role() {
        team::Role::Leader => return team::post(parts, &part),
        // A product inside a part of the leader's: the members are busy spinning.
        team::Role::Posting => return (0..parts).for_each(part),
        team::Role::None => {}
    }
    rayon::in_place_scope(|scope| {
        let part = &part;
        for i in 1..parts {
            scope.spawn(move |_| part(i));
        }
        if parts > 0 {
            part(0);
        }
    });
}

/// The kind of a model's step, which says how the members of its [`team`] wait for the next
/// product.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// A decoding step (one new token a row), whose products come every few tens of
    /// microseconds: the members spin until it ends.
    Decoding,
    /// A prompt or an encoder. Until the process's first decoding step the members sleep after
    /// tens of microseconds without a part: the first steps of a process run while V8 compiles
    /// their optimised code on a background thread, and members spinning through the prompt's
    /// stretches of one-thread work took the core it needed (int8 SmolLM2's first prompt on 2
    /// threads in Chromium: 0.33-0.34 s with members spinning, 0.17-0.21 s with members
    /// sleeping, 0.24 s on one thread). After it they spin: with members that slept in prompts
    /// after spinning through decoding steps, every later int8 prompt took 0.31-0.35 s instead
    /// of 0.11 s (not understood; fp32's, q4's and fp16's did not move).
    Other,
}

/// Runs `step` (a model's step: many products a few tens of microseconds each) with the pool's
/// workers waiting for the parts of its products on a board (see [`Step`]), from which a part
/// starts within microseconds: rayon's workers fall asleep between products, and waking one
/// cost what the split saved (2 threads in Chromium, q4 SmolLM2: 44.9 tok/s with every product
/// split, 44.9 with only the `lm_head`'s, 41 on one thread; 63-78 on a team that spins, 50-59
/// with members that slept after tens of microseconds without a part). Without the `threads`
/// feature, with one thread, on a worker of the pool, or while another team runs, `step` runs
/// as it is (its products on rayon's pool).
pub fn team<R>(kind: Step, step: impl FnOnce() -> R) -> R {
    #[cfg(feature = "threads")]
    {
        team::run(kind, step)
    }
    #[cfg(not(feature = "threads"))]
    {
        let _ = kind;
        step()
    }
}

/// The one team of the process: its leader posts a product's parts on a board that the members
/// (rayon jobs that spin until the team ends) and the leader claim one at a time.
#[cfg(feature = "threads")]
mod team {
    use std::cell::Cell;
    use std::hint::spin_loop;
    use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
    use std::sync::OnceLock;

    /// The product of the moment. `claim` packs its number (the high 32 bits), its count of
    /// parts (16 bits) and the next part to claim (the low 16): a member that claims part `i`
    /// of product `e` by a compare-and-swap of the whole word knows that `call` and `data`,
    /// read after the word, were `e`'s (the leader writes the next product's only once every
    /// part of `e` has run, which needs this member's part).
    struct Board {
        claim: AtomicU64,
        /// `trampoline::<F>` as an address.
        call: AtomicUsize,
        /// The `F` it calls.
        data: AtomicPtr<()>,
        /// Parts of the product that have run.
        done: AtomicUsize,
        /// The team has ended: the members return.
        stop: AtomicBool,
    }

    static BOARD: Board = Board {
        claim: AtomicU64::new(0),
        call: AtomicUsize::new(0),
        data: AtomicPtr::new(std::ptr::null_mut()),
        done: AtomicUsize::new(0),
        stop: AtomicBool::new(true),
    };

    /// A team exists (one at a time).
    static ACTIVE: AtomicBool = AtomicBool::new(false);

    /// A decoding step has run in this process (`super::Step`).
    static DECODED: AtomicBool = AtomicBool::new(false);

    thread_local! {
        /// This thread leads the team.
        static LEADER: Cell<bool> = const { Cell::new(false) };
        /// This thread is posting a product (a product inside a part runs on its thread).
        static POSTING: Cell<bool> = const { Cell::new(false) };
    }

    fn unpack(c: u64) -> (u64, usize, usize) {
        (
            c >> 32,
            ((c >> 16) & 0xffff) as usize,
            (c & 0xffff) as usize,
        )
    }

    pub enum Role {
        /// This thread leads a team and may post a product.
        Leader,
        /// This thread leads a team and is posting a product.
        Posting,
        None,
    }

    pub fn role() -> Role {
        match (LEADER.get(), POSTING.get()) {
            (true, false) => Role::Leader,
            (true, true) => Role::Posting,
            _ => Role::None,
        }
    }

    /// Ends the team when `step` returns or unwinds: the members return.
    struct Ending;

    impl Drop for Ending {
        fn drop(&mut self) {
            BOARD.stop.store(true, Ordering::Release);
            bell::ring();
            LEADER.set(false);
        }
    }

    /// Lets the next team start once this one's members have returned.
    struct Active;

    impl Drop for Active {
        fn drop(&mut self) {
            ACTIVE.store(false, Ordering::Release);
        }
    }

    pub fn run<R>(kind: super::Step, step: impl FnOnce() -> R) -> R {
        // One member per other core where the number of cores is known (natively, rayon's
        // pool has one thread per core beside the calling thread; a spinning member on a core
        // the leader needs would slow it).
        // (Read once: natively it reads the process's CPU limits from files.)
        static CORES: OnceLock<Option<usize>> = OnceLock::new();
        let cores =
            *CORES.get_or_init(|| std::thread::available_parallelism().ok().map(|c| c.get()));
        let members = super::threads().saturating_sub(1);
        let members = cores.map_or(members, |cores| members.min(cores - 1));
        if members == 0
            || rayon::current_thread_index().is_some()
            || ACTIVE
                .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
                .is_err()
        {
            return step();
        }
        let _active = Active;
        BOARD.stop.store(false, Ordering::Release);
        LEADER.set(true);
        rayon::in_place_scope(|scope| {
            if kind == super::Step::Decoding {
                DECODED.store(true, Ordering::Relaxed);
            }
            // Rounds of the spin loop without a part before a member sleeps (`super::Step`).
            let spins = if DECODED.load(Ordering::Relaxed) {
                u32::MAX
            } else {
                SPINS
            };
            for _ in 0..members {
                scope.spawn(move |_| member(spins));
            }
            let _ending = Ending;
            step()
        })
    }

    /// Rounds of the spin loop without a part after which a member of a team that may sleep
    /// (`super::Step::Other`) sleeps until the next product: tens of microseconds.
    const SPINS: u32 = 1 << 16;

    fn member(spins: u32) {
        let mut idle = 0;
        while !BOARD.stop.load(Ordering::Acquire) {
            if claim_part() {
                idle = 0;
            } else if idle < spins {
                idle += 1;
                spin_loop();
            } else {
                idle = 0;
                bell::sleep();
            }
        }
    }

    /// Where idle members sleep: `post` and the team's end ring it.
    mod bell {
        use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering::SeqCst};

        /// Rings: a member sleeps only while it has not changed.
        static BELL: AtomicU32 = AtomicU32::new(0);
        /// Members asleep or about to sleep.
        static SLEEPERS: AtomicUsize = AtomicUsize::new(0);

        /// Sleeps until the next ring (or 10 ms), unless a part or the team's end came first.
        /// (A ring after the bell is read here either sees this member among the sleepers
        /// and wakes it, or changed the bell before the member's wait compares it.)
        pub fn sleep() {
            let rung = BELL.load(SeqCst);
            SLEEPERS.fetch_add(1, SeqCst);
            if !super::has_work() {
                wait(&BELL, rung);
            }
            SLEEPERS.fetch_sub(1, SeqCst);
        }

        pub fn ring() {
            BELL.fetch_add(1, SeqCst);
            if SLEEPERS.load(SeqCst) > 0 {
                notify(&BELL);
            }
        }

        #[cfg(all(target_arch = "wasm32", target_feature = "atomics"))]
        fn wait(bell: &AtomicU32, rung: u32) {
            // SAFETY: the address of a live, aligned 32-bit atomic. Members are the pool's
            // workers (Web Workers), where waiting is allowed; the page's thread only rings.
            unsafe {
                core::arch::wasm32::memory_atomic_wait32(
                    bell.as_ptr() as *mut i32,
                    rung as i32,
                    10_000_000,
                );
            }
        }

        #[cfg(all(target_arch = "wasm32", target_feature = "atomics"))]
        fn notify(bell: &AtomicU32) {
            // SAFETY: as in `wait`.
            unsafe {
                core::arch::wasm32::memory_atomic_notify(bell.as_ptr() as *mut i32, u32::MAX);
            }
        }

        /// Natively (tests) a member yields its core instead.
        #[cfg(not(all(target_arch = "wasm32", target_feature = "atomics")))]
        fn wait(_bell: &AtomicU32, _rung: u32) {
            std::thread::yield_now();
        }

        #[cfg(not(all(target_arch = "wasm32", target_feature = "atomics")))]
        fn notify(_bell: &AtomicU32) {}
    }

    /// A product with parts to claim is on the board, or the team has ended.
    fn has_work() -> bool {
        let (_, parts, next) = unpack(BOARD.claim.load(Ordering::SeqCst));
        next < parts || BOARD.stop.load(Ordering::SeqCst)
    }

    /// Counts a part as run when it returns or unwinds.
    struct Done;

    impl Drop for Done {
        fn drop(&mut self) {
            BOARD.done.fetch_add(1, Ordering::Release);
        }
    }

    /// Claims and runs one part of the product on the board; false when none is left.
    fn claim_part() -> bool {
        let c = BOARD.claim.load(Ordering::Acquire);
        let (_, parts, next) = unpack(c);
        if next >= parts {
            return false;
        }
        let call = BOARD.call.load(Ordering::Acquire);
        let data = BOARD.data.load(Ordering::Acquire);
        if BOARD
            .claim
            .compare_exchange(c, c + 1, Ordering::AcqRel, Ordering::Relaxed)
            .is_err()
        {
            return true;
        }
        let _done = Done;
        // SAFETY: `call` is `trampoline::<F>` and `data` the `F` that `post` put on the board
        // for this product (see `Board`); `post` does not return before this part has run.
        unsafe {
            let call: unsafe fn(*const (), usize) = std::mem::transmute(call);
            call(data, next);
        }
        true
    }

    /// # Safety
    /// `data` must point to a live `F`.
    unsafe fn trampoline<F: Fn(usize)>(data: *const (), part: usize) {
        (*(data as *const F))(part)
    }

    /// Waits, when `post` returns or unwinds, until every part has run: parts left unclaimed
    /// (the leader's own part unwound) are counted as run first.
    struct Wait(usize);

    impl Drop for Wait {
        fn drop(&mut self) {
            loop {
                let c = BOARD.claim.load(Ordering::Acquire);
                let (_, parts, next) = unpack(c);
                if next >= parts {
                    break;
                }
                let all = c - next as u64 + parts as u64;
                if BOARD
                    .claim
                    .compare_exchange(c, all, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
                {
                    BOARD.done.fetch_add(parts - next, Ordering::Release);
                    break;
                }
            }
            while BOARD.done.load(Ordering::Acquire) < self.0 {
                spin_loop();
            }
            POSTING.set(false);
        }
    }

    /// Runs `part(0..parts)` on the team and returns when every part has run.
    pub fn post<F: Fn(usize) + Sync>(parts: usize, part: &F) {
        if parts > 0xffff {
            return (0..parts).for_each(part);
        }
        POSTING.set(true);
        let (epoch, _, _) = unpack(BOARD.claim.load(Ordering::Relaxed));
        BOARD
            .call
            .store(trampoline::<F> as *const () as usize, Ordering::Relaxed);
        BOARD
            .data
            .store(part as *const F as *mut (), Ordering::Relaxed);
        BOARD.done.store(0, Ordering::Relaxed);
        let _wait = Wait(parts);
        let next = ((epoch + 1) & 0xffff_ffff) << 32 | (parts as u64) << 16;
        BOARD.claim.store(next, Ordering::Release);
        bell::ring();
        while claim_part() {}
    }
}

/// Copies each block (`[rows, cols.len()]`) into its columns of `out` (`[rows, n]`).
fn place<T: Copy>(out: &mut [T], n: usize, ranges: &[Range<usize>], blocks: &[Vec<T>]) {
    for (cols, block) in ranges.iter().zip(blocks) {
        for (r, src) in block.chunks_exact(cols.len()).enumerate() {
            out[r * n + cols.start..r * n + cols.end].copy_from_slice(src);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_cover_the_columns_in_aligned_parts() {
        assert_eq!(ranges(10, 2, 4), vec![0..8, 8..10]);
        assert_eq!(ranges(16, 2, 4), vec![0..8, 8..16]);
        assert_eq!(ranges(3, 4, 4), vec![0..3]);
        assert_eq!(ranges(9, 3, 1), vec![0..3, 3..6, 6..9]);
        assert_eq!(ranges(7, 1, 4), vec![0..7]);
    }

    #[test]
    fn map_ranges_keeps_the_order_of_the_ranges() {
        for parts in 1..5 {
            let got = map_ranges(10, parts, 4, |r| (r.start, r.end));
            let want: Vec<_> = ranges(10, parts, 4)
                .iter()
                .map(|r| (r.start, r.end))
                .collect();
            assert_eq!(got, want, "{parts} parts");
        }
    }

    #[test]
    fn by_columns_places_every_block() {
        let (rows, n) = (3, 10);
        let kernel = |cols: Range<usize>, block: &mut [f32]| {
            let w = cols.len();
            for r in 0..rows {
                for (c, col) in cols.clone().enumerate() {
                    block[r * w + c] = (r * 100 + col) as f32;
                }
            }
        };
        let want: Vec<f32> = (0..rows * n)
            .map(|i| ((i / n) * 100 + i % n) as f32)
            .collect();
        for parts in 1..5 {
            let mut out = vec![0f32; rows * n];
            by_columns(&mut out, rows, n, 4, parts, kernel);
            assert_eq!(out, want, "{parts} parts");
        }
    }

    /// The products of a team (`cargo test --features threads`): members run parts, every part
    /// runs once, the results are placed as without a team, products inside a part and teams
    /// inside a team run as they are, and a second thread's products wait for no team.
    #[cfg(feature = "threads")]
    #[test]
    fn a_team_runs_every_part_once() {
        let (rows, n) = (3, 37);
        let kernel = |cols: Range<usize>, block: &mut [f32]| {
            let w = cols.len();
            for r in 0..block.len() / w {
                for (c, col) in cols.clone().enumerate() {
                    block[r * w + c] += (r * 100 + col) as f32;
                }
            }
        };
        let want: Vec<f32> = (0..rows * n)
            .map(|i| ((i / n) * 100 + i % n) as f32)
            .collect();
        let leader = std::thread::current().id();
        let elsewhere = std::sync::atomic::AtomicBool::new(false);
        let products = |label: &str| {
            for round in 0..2000 {
                let parts = 1 + round % 4;
                for rows in [1, rows] {
                    let mut out = vec![0f32; rows * n];
                    by_columns(&mut out, rows, n, 4, parts, kernel);
                    assert_eq!(out, want[..rows * n], "{label}: round {round}, {rows} rows");
                }
                let got = map_ranges(n, parts, 4, |r| {
                    // A product inside a part.
                    let mut inner = vec![0f32; n];
                    by_columns(&mut inner, 1, n, 4, 2, kernel);
                    assert_eq!(inner, want[..n], "{label}: inside a part");
                    if std::thread::current().id() != leader {
                        elsewhere.store(true, Ordering::Relaxed);
                    }
                    r.len()
                });
                assert_eq!(got.iter().sum::<usize>(), n, "{label}: round {round}");
            }
        };
        team(Step::Other, || products("a team that sleeps"));
        team(Step::Decoding, || {
            products("team");
            team(Step::Decoding, || products("a team inside a team"));
        });
        assert!(
            elsewhere.load(Ordering::Relaxed),
            "no part ran on a member of the team"
        );
        std::thread::scope(|s| {
            s.spawn(|| team(Step::Decoding, || products("first thread")));
            s.spawn(|| team(Step::Other, || products("second thread")));
        });
        products("no team");
    }
}
