//! Byte ranges over the pager: what NBD commands do to pages.
//!
//! The kernel and NBD clients address bytes; the pager addresses 4 KiB pages. A request that
//! covers whole pages maps onto batched pager reads and writes; a partial page at either end is
//! read, modified and written back. A page written all zeros, WRITE_ZEROES and TRIM of whole
//! pages all *discard* the page: its remote copies are deleted (Nswap's garbage collection of
//! dead pages; the kernel discards freed swap slots) and it reads as zeros without any I/O, so an
//! all-zero page is stored as nothing at all rather than as 4 KiB.
//!
//! One pager serves every connection, behind one mutex: a FLUSH on any connection writes back
//! the whole cache, which is what makes NBD multi-conn safe here. Reads, writes of whole
//! pages, TRIM, CACHE and FLUSH do not hold it across a round trip (`netram_client::shared`), and neither
//! does a partial page's read-modify-write: its page is read into the cache by ticket first.

use netram_client::SharedPager;
use netram_pager::{Disk, Pager, PagerError, Transport};
use netram_proto::PAGE_SIZE;
use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::task::{Context, Poll, Waker};

/// How a device operation waits for the pager. Every operation is written once, as an
/// `async fn` generic over this; the waits are what differs:
/// * [`Blocking`]: the calling thread waits (FUSE's threads, a connection's thread, the plain
///   methods of [`Device`]); its futures never pend, and [`now`] runs them;
/// * [`Looped`]: a task of the NBD server's transmission loop (`crate::transmit`): a wait is
///   `Poll::Pending`, and the loop, which watches the page servers' connections, wakes it.
///
/// Neither holds the pager's lock across a round trip (`netram_client::shared`).
pub trait Waits {
    fn read_pages<'a, T: Transport, D: Disk>(
        pager: &'a SharedPager<T, D>,
        pages: &'a [u64],
        out: &'a mut Vec<u8>,
    ) -> impl Future<Output = Result<(), PagerError>> + 'a;
    fn drive<'a, T: Transport, D: Disk>(
        pager: &'a SharedPager<T, D>,
        what: &'static str,
        step: impl FnMut(&mut Pager<T, D>, bool) -> Result<bool, PagerError> + 'a,
    ) -> impl Future<Output = Result<(), PagerError>> + 'a;
    fn write_pages<'a, T: Transport, D: Disk>(
        pager: &'a SharedPager<T, D>,
        pages: &'a [u64],
        data: &'a [u8],
    ) -> impl Future<Output = Result<(), PagerError>> + 'a;
    fn discard_pages<'a, T: Transport, D: Disk>(
        pager: &'a SharedPager<T, D>,
        pages: &'a [u64],
    ) -> impl Future<Output = Result<(), PagerError>> + 'a;
    fn flush<'a, T: Transport, D: Disk>(
        pager: &'a SharedPager<T, D>,
        only: Option<&'a [u64]>,
    ) -> impl Future<Output = Result<(), PagerError>> + 'a;
}

/// The calling thread waits (see [`Waits`]).
#[derive(Debug)]
pub struct Blocking;

impl Waits for Blocking {
    async fn read_pages<T: Transport, D: Disk>(
        pager: &SharedPager<T, D>,
        pages: &[u64],
        out: &mut Vec<u8>,
    ) -> Result<(), PagerError> {
        pager.read_pages(pages, out)
    }
    async fn drive<'a, T: Transport, D: Disk>(
        pager: &'a SharedPager<T, D>,
        what: &'static str,
        step: impl FnMut(&mut Pager<T, D>, bool) -> Result<bool, PagerError> + 'a,
    ) -> Result<(), PagerError> {
        pager.drive(what, step)
    }
    async fn write_pages<T: Transport, D: Disk>(
        pager: &SharedPager<T, D>,
        pages: &[u64],
        data: &[u8],
    ) -> Result<(), PagerError> {
        pager.write_pages(pages, data)
    }
    async fn discard_pages<T: Transport, D: Disk>(
        pager: &SharedPager<T, D>,
        pages: &[u64],
    ) -> Result<(), PagerError> {
        pager.discard_pages(pages)
    }
    async fn flush<T: Transport, D: Disk>(
        pager: &SharedPager<T, D>,
        only: Option<&[u64]>,
    ) -> Result<(), PagerError> {
        pager.flush(only)
    }
}

/// A task of an event loop: waits pend (see [`Waits`]).
#[derive(Debug)]
pub struct Looped;

impl Waits for Looped {
    async fn read_pages<T: Transport, D: Disk>(
        pager: &SharedPager<T, D>,
        pages: &[u64],
        out: &mut Vec<u8>,
    ) -> Result<(), PagerError> {
        pager.read_pages_async(pages, out).await
    }
    fn drive<'a, T: Transport, D: Disk>(
        pager: &'a SharedPager<T, D>,
        _what: &'static str,
        step: impl FnMut(&mut Pager<T, D>, bool) -> Result<bool, PagerError> + 'a,
    ) -> impl Future<Output = Result<(), PagerError>> + 'a {
        pager.drive_async(step)
    }
    async fn write_pages<T: Transport, D: Disk>(
        pager: &SharedPager<T, D>,
        pages: &[u64],
        data: &[u8],
    ) -> Result<(), PagerError> {
        pager.write_pages_async(pages, data).await
    }
    async fn discard_pages<T: Transport, D: Disk>(
        pager: &SharedPager<T, D>,
        pages: &[u64],
    ) -> Result<(), PagerError> {
        pager.discard_pages_async(pages).await
    }
    async fn flush<T: Transport, D: Disk>(
        pager: &SharedPager<T, D>,
        only: Option<&[u64]>,
    ) -> Result<(), PagerError> {
        pager.flush_async(only).await
    }
}

/// Runs a future of [`Blocking`] waits, which never pends, to its end.
pub fn now<F: Future>(f: F) -> F::Output {
    let mut f = std::pin::pin!(f);
    match f.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(v) => v,
        Poll::Pending => unreachable!("an operation that blocks never pends"),
    }
}

/// The largest request served; larger ones are refused with EINVAL (advertised as the maximum
/// block size).
pub const MAX_REQUEST: u32 = 32 << 20;

/// Bytes a TRIM, WRITE_ZEROES or CACHE works on per acquisition of the pager: a large range is
/// done in steps, so that it holds neither the pager nor memory in proportion to its length,
/// and other connections' requests run in between. A multiple of the page size.
pub const STEP_BYTES: u64 = 8 << 20;

/// `offset..offset + len` in pieces that end on multiples of [`STEP_BYTES`].
fn steps(offset: u64, len: u64) -> impl Iterator<Item = (u64, u64)> {
    let end = offset.saturating_add(len);
    let mut at = offset;
    std::iter::from_fn(move || {
        (at < end).then(|| {
            let next = ((at / STEP_BYTES + 1) * STEP_BYTES).min(end);
            let piece = (at, next - at);
            at = next;
            piece
        })
    })
}

const PAGE: u64 = PAGE_SIZE as u64;

#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error(transparent)]
    Pager(#[from] PagerError),
}

/// A block device of `size` bytes on the pages of one pager.
pub struct Device<T: Transport, D: Disk> {
    inner: SharedPager<T, D>,
    size: u64,
}

impl<T: Transport, D: Disk> std::fmt::Debug for Device<T, D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device").field("size", &self.size).finish()
    }
}

/// The pages a byte range touches, and for each the part of it the range covers.
/// Pages of a write made and handed to the pager together, under one hold of the lock.
const RUN_PAGES: usize = 64;

/// Rounds of a partial write ([`Device::put_many`]) whose partial pages are read without the
/// lock before one is read the waiting way: only a page whose version moves at every round
/// (another connection writing it again and again, out of the cache each time) gets there.
const PARTIAL_ROUNDS: usize = 8;

/// One write's bytes on one page: `start..stop`, from the slice, or zeros.
type Piece<'a> = (usize, usize, Option<&'a [u8]>);

fn is_whole((start, stop, _): Piece<'_>) -> bool {
    stop - start == PAGE_SIZE
}

fn pages_of(offset: u64, len: u64) -> impl Iterator<Item = (u64, usize, usize)> {
    let end = offset + len;
    let first = offset / PAGE;
    let last = if len == 0 {
        first
    } else {
        (end - 1) / PAGE + 1
    };
    (first..last).map(move |p| {
        let start = offset.max(p * PAGE) - p * PAGE;
        let stop = end.min((p + 1) * PAGE) - p * PAGE;
        (p, start as usize, stop as usize)
    })
}

impl<T: Transport, D: Disk> Device<T, D> {
    /// `size` must fit in the pager's pages.
    pub fn new(pager: Pager<T, D>, size: u64) -> Self {
        assert!(
            size <= pager.config().pages * PAGE,
            "device larger than its pager"
        );
        Self {
            inner: SharedPager::new(pager),
            size,
        }
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    /// The pager, under the device's lock.
    fn pager(&self) -> impl std::ops::DerefMut<Target = Pager<T, D>> + '_ {
        self.inner.lock()
    }

    pub fn into_pager(self) -> Pager<T, D> {
        self.inner.into_pager()
    }

    /// Runs `f` on the pager, e.g. to read its counters or close its sessions.
    pub fn with_pager<R>(&self, f: impl FnOnce(&mut Pager<T, D>) -> R) -> R {
        f(&mut self.pager())
    }

    /// Whether a connection's read or write is under way (`SharedPager::busy`): it takes in
    /// the replies that come, whoever they are for.
    pub fn busy(&self) -> bool {
        self.inner.busy()
    }

    /// Reads `out.len()` bytes at `offset`.
    pub fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), DeviceError> {
        out.copy_from_slice(&self.read_ranges(&[(offset, out.len() as u32)])?);
        Ok(())
    }

    /// The pager, shared by the device's users.
    pub fn shared(&self) -> &SharedPager<T, D> {
        &self.inner
    }

    /// Reads several ranges with one pipelined pager read of all their pages; returns their
    /// bytes one after the other.
    pub fn read_ranges(&self, ranges: &[(u64, u32)]) -> Result<Vec<u8>, DeviceError> {
        let mut data = Vec::new();
        self.read_ranges_into(ranges, &mut data)?;
        Ok(data)
    }

    /// [`Device::read_ranges`] into a buffer the caller keeps from one request to the next,
    /// so that serving reads allocates nothing once the buffer has grown to its working size.
    pub fn read_ranges_into(
        &self,
        ranges: &[(u64, u32)],
        data: &mut Vec<u8>,
    ) -> Result<(), DeviceError> {
        now(self.read_ranges_in::<Blocking>(ranges, data))
    }

    /// [`Device::read_ranges_into`], waiting as `W` does.
    pub async fn read_ranges_in<W: Waits>(
        &self,
        ranges: &[(u64, u32)],
        data: &mut Vec<u8>,
    ) -> Result<(), DeviceError> {
        let total: usize = ranges.iter().map(|&(_, l)| l as usize).sum();
        data.clear();
        let aligned = ranges
            .iter()
            .all(|&(o, l)| o % PAGE == 0 && u64::from(l) % PAGE == 0);
        let numbers: Vec<u64> = ranges
            .iter()
            .flat_map(|&(o, l)| pages_of(o, u64::from(l)).map(|p| p.0))
            .collect();
        if aligned {
            // Whole pages, the kernel's and fio's case: straight into the caller's buffer.
            debug_assert_eq!(total, numbers.len() * PAGE_SIZE);
            W::read_pages(&self.inner, &numbers, data).await?;
            return Ok(());
        }
        let mut buf = Vec::new();
        W::read_pages(&self.inner, &numbers, &mut buf).await?;
        data.reserve(total);
        let parts = ranges.iter().flat_map(|&(o, l)| pages_of(o, u64::from(l)));
        for (i, (_, start, stop)) in parts.enumerate() {
            data.extend_from_slice(&buf[i * PAGE_SIZE + start..i * PAGE_SIZE + stop]);
        }
        Ok(())
    }

    /// Applies writes in order: each is `data` at `offset` (`Some`) or `len` zeros (`None`).
    /// Each page's pieces are gathered first, so that a later write's bytes land over an
    /// earlier one's; then page by page, each under one hold of the lock, its content is made
    /// (a partial page from its current content, at hand in the cache or read by ticket and
    /// still current) and goes to the pager as a write into the cache, or a discard if it is
    /// all zeros. Nothing holds the device across a round trip: a page waits for a slot or for
    /// its last write-back with the lock let go (`netram_client::shared`), and a partial page
    /// that is not at hand is read by ticket without the lock, then taken up again (see the
    /// rounds below). Its merge and its write are in one hold, so that no other connection's
    /// write of the page comes in between. With `fua`, everything is on its backing before
    /// this returns.
    async fn put_many<W: Waits>(
        &self,
        writes: &[(u64, u64, Option<&[u8]>)],
        fua: bool,
    ) -> Result<(), DeviceError> {
        if let Some(result) = self.put_whole_pages::<W>(writes, fua).await {
            return result;
        }
        // page -> its pieces (start, stop, bytes or zeros), in the order written; a whole
        // page's piece replaces every earlier one.
        let mut pieces: BTreeMap<u64, Vec<Piece<'_>>> = BTreeMap::new();
        for &(offset, len, data) in writes {
            let mut at = 0usize;
            for (p, start, stop) in pages_of(offset, len) {
                let n = stop - start;
                let on_page = pieces.entry(p).or_default();
                if n == PAGE_SIZE {
                    on_page.clear();
                }
                on_page.push((start, stop, data.map(|d| &d[at..at + n])));
                at += n;
            }
        }
        let plan: Vec<(u64, Vec<Piece<'_>>)> = pieces.into_iter().collect();
        let mut done = 0;
        let mut page = vec![0u8; PAGE_SIZE];
        let (mut run, mut run_data) = (Vec::new(), Vec::new());
        // Partial pages read by ticket for the rounds after the cache's: each with the version
        // the page table gave it before its read started, and where its data is in `read_buf`.
        let mut read: HashMap<u64, (u32, usize)> = HashMap::new();
        let mut read_buf = Vec::new();
        let cached = self.pager().config().cache_pages > 0;
        // A partial page not at hand when its turn comes (never brought in, or evicted since
        // by other connections' pages) sends this back for another round. The first two bring
        // the pages into the cache by ticket (`bring_in`); later ones (and every one without a
        // cache, or with a cache too small for the pages in flight) read them by ticket into a
        // buffer of this call's, whose page is merged only if the page's version is still the
        // one from before its read: versions never go back, so an equal one means no write of
        // the page came in between (one that did is in the cache, in write-back, or a newer
        // version). Nothing holds the device across a round trip. Only a page whose version
        // moves at every round for [`PARTIAL_ROUNDS`] rounds is read the waiting way, under
        // the lock, as every partial page was before.
        for round in 0.. {
            let partial: Vec<u64> = plan[done..]
                .iter()
                .filter(|(_, on_page)| !is_whole(on_page[0]))
                .map(|&(p, _)| p)
                .collect();
            if cached && round < 2 {
                self.bring_in::<W>(&partial).await?;
            } else if !partial.is_empty() && round < PARTIAL_ROUNDS {
                let mut versions = Vec::new();
                W::drive(&self.inner, "writing", |pager, _| {
                    versions = partial
                        .iter()
                        .map(|&p| pager.location(p).map(|l| l.version))
                        .collect();
                    Ok(true)
                })
                .await?;
                W::read_pages(&self.inner, &partial, &mut read_buf).await?;
                read = partial
                    .iter()
                    .zip(versions)
                    .enumerate()
                    .filter_map(|(i, (&p, v))| Some((p, (v?, i * PAGE_SIZE))))
                    .collect();
            }
            let mut missing = false;
            W::drive(&self.inner, "writing", |pager, wait| {
                // Runs of pages with data go to the pager together (one batch of sends), each
                // made in the same hold that writes it; a page of zeros is discarded on its own.
                // One page at most when waiting: then back to not waiting.
                let most = if wait { 1 } else { RUN_PAGES };
                while done < plan.len() {
                    run.clear();
                    run_data.clear();
                    let mut zero = None;
                    while let Some((p, on_page)) = plan.get(done + run.len()) {
                        if run.len() == most {
                            break;
                        }
                        if is_whole(on_page[0]) {
                            page.fill(0);
                        } else if !pager.read_at_hand(*p, &mut page)? {
                            let current = pager.location(*p).map(|l| l.version);
                            match read.get(p) {
                                Some(&(v, at)) if current == Some(v) => {
                                    page.copy_from_slice(&read_buf[at..at + PAGE_SIZE]);
                                }
                                _ if round < PARTIAL_ROUNDS => {
                                    missing = true;
                                    break;
                                }
                                _ => pager.read(*p, &mut page)?,
                            }
                        }
                        for &(start, stop, src) in on_page {
                            match src {
                                Some(d) => page[start..stop].copy_from_slice(d),
                                None => page[start..stop].fill(0),
                            }
                        }
                        if page.iter().all(|&b| b == 0) {
                            if run.is_empty() {
                                zero = Some(*p);
                            }
                            break;
                        }
                        run.push(*p);
                        run_data.extend_from_slice(&page);
                    }
                    let (taken, wanted) = match (zero, wait) {
                        (Some(p), false) => (usize::from(pager.try_discard(p)?), 1),
                        (Some(p), true) => (pager.discard_many(&[p]).map(|()| 1)?, 1),
                        (None, _) if run.is_empty() => break,
                        (None, false) => (pager.try_write_many(&run, &run_data)?, run.len()),
                        (None, true) => (pager.write_many(&run, &run_data).map(|()| 1)?, 1),
                    };
                    done += taken;
                    if taken < wanted || wait {
                        break;
                    }
                }
                pager.send_queued();
                Ok(done == plan.len() || missing)
            })
            .await?;
            if !missing {
                break;
            }
        }
        if fua {
            let written: Vec<u64> = plan.iter().map(|&(p, _)| p).collect();
            W::flush(&self.inner, Some(&written)).await?;
        }
        Ok(())
    }

    /// Reads `pages` into the pager's cache by ticket, without holding the device across the
    /// round trip, so that their read-modify-write under the lock finds them there. Nothing to
    /// do without a cache (the read-modify-write then reads them the waiting way).
    async fn bring_in<W: Waits>(&self, pages: &[u64]) -> Result<(), DeviceError> {
        if pages.is_empty() || self.pager().config().cache_pages == 0 {
            return Ok(());
        }
        let mut scratch = Vec::new();
        W::read_pages(&self.inner, pages, &mut scratch).await?;
        Ok(())
    }

    /// The common case of [`Device::put_many`] without staging: writes of whole, aligned pages,
    /// no page written twice. Each run of non-zero pages goes to the pager straight from the
    /// request's buffer, without holding the device across a round trip (`netram_client::shared`).
    /// `None` if the writes are not of that kind.
    async fn put_whole_pages<W: Waits>(
        &self,
        writes: &[(u64, u64, Option<&[u8]>)],
        fua: bool,
    ) -> Option<Result<(), DeviceError>> {
        let aligned = writes
            .iter()
            .all(|&(o, l, d)| o % PAGE == 0 && l % PAGE == 0 && d.is_some());
        if !aligned {
            return None;
        }
        let mut spans: Vec<(u64, u64)> = writes.iter().map(|&(o, l, _)| (o, o + l)).collect();
        spans.sort_unstable();
        if spans.windows(2).any(|w| w[1].0 < w[0].1) {
            return None;
        }
        let result = async {
            let mut zero_pages = Vec::new();
            let mut numbers = Vec::new();
            for &(offset, len, data) in writes {
                let data = data.expect("checked above");
                let first = offset / PAGE;
                let mut run_start = 0usize;
                numbers.clear();
                for i in 0..(len / PAGE) as usize {
                    let page = &data[i * PAGE_SIZE..(i + 1) * PAGE_SIZE];
                    if page.iter().all(|&b| b == 0) {
                        if !numbers.is_empty() {
                            W::write_pages(
                                &self.inner,
                                &numbers,
                                &data[run_start * PAGE_SIZE..i * PAGE_SIZE],
                            )
                            .await?;
                            numbers.clear();
                        }
                        zero_pages.push(first + i as u64);
                        run_start = i + 1;
                    } else {
                        numbers.push(first + i as u64);
                    }
                }
                if !numbers.is_empty() {
                    W::write_pages(&self.inner, &numbers, &data[run_start * PAGE_SIZE..]).await?;
                }
            }
            if !zero_pages.is_empty() {
                W::discard_pages(&self.inner, &zero_pages).await?;
            }
            if fua {
                // Only this batch's pages need to be stored before it is answered.
                let written: Vec<u64> = writes
                    .iter()
                    .flat_map(|&(offset, len, _)| offset / PAGE..(offset + len) / PAGE)
                    .collect();
                W::flush(&self.inner, Some(&written)).await?;
            }
            Ok::<(), DeviceError>(())
        }
        .await;
        Some(result)
    }

    pub fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), DeviceError> {
        now(self.put_many::<Blocking>(&[(offset, data.len() as u64, Some(data))], fua))
    }

    /// Several writes of one pipeline batch, in order, as one batched pager write.
    pub fn write_many(&self, writes: &[(u64, &[u8])], fua: bool) -> Result<(), DeviceError> {
        now(self.write_many_in::<Blocking>(writes, fua))
    }

    /// [`Device::write_many`], waiting as `W` does.
    pub async fn write_many_in<W: Waits>(
        &self,
        writes: &[(u64, &[u8])],
        fua: bool,
    ) -> Result<(), DeviceError> {
        let writes: Vec<(u64, u64, Option<&[u8]>)> = writes
            .iter()
            .map(|&(o, d)| (o, d.len() as u64, Some(d)))
            .collect();
        self.put_many::<W>(&writes, fua).await
    }

    /// Zeroes the range, [`STEP_BYTES`] at a time (see there).
    pub fn write_zeroes(&self, offset: u64, len: u64, fua: bool) -> Result<(), DeviceError> {
        now(self.write_zeroes_in::<Blocking>(offset, len, fua))
    }

    /// [`Device::write_zeroes`], waiting as `W` does.
    pub async fn write_zeroes_in<W: Waits>(
        &self,
        offset: u64,
        len: u64,
        fua: bool,
    ) -> Result<(), DeviceError> {
        for (o, l) in steps(offset, len) {
            self.put_many::<W>(&[(o, l, None)], false).await?;
        }
        if fua {
            self.flush_in::<W>().await?;
        }
        Ok(())
    }

    /// Discards the whole pages in the range, [`STEP_BYTES`] at a time. Partial pages are left
    /// as they are: after a TRIM a client may assume nothing about the range until it writes it
    /// again.
    pub fn trim(&self, offset: u64, len: u64) -> Result<(), DeviceError> {
        now(self.trim_in::<Blocking>(offset, len))
    }

    /// [`Device::trim`], waiting as `W` does.
    pub async fn trim_in<W: Waits>(&self, offset: u64, len: u64) -> Result<(), DeviceError> {
        for (o, l) in steps(offset, len) {
            let whole: Vec<u64> = pages_of(o, l)
                .filter(|&(_, start, stop)| stop - start == PAGE_SIZE)
                .map(|(p, _, _)| p)
                .collect();
            W::discard_pages(&self.inner, &whole).await?;
        }
        Ok(())
    }

    /// Writes every page dirty in the cache now to its backing and waits until all are
    /// acknowledged, without holding the device across the round trips (`SharedPager::flush`).
    pub fn flush(&self) -> Result<(), DeviceError> {
        now(self.flush_in::<Blocking>())
    }

    /// [`Device::flush`], waiting as `W` does.
    pub async fn flush_in<W: Waits>(&self) -> Result<(), DeviceError> {
        W::flush(&self.inner, None).await?;
        Ok(())
    }

    /// Brings the range into the pager's cache (NBD_CMD_CACHE), [`STEP_BYTES`] at a time, by
    /// reads by ticket that do not hold the device across their round trips.
    pub fn cache(&self, offset: u64, len: u64) -> Result<(), DeviceError> {
        now(self.cache_in::<Blocking>(offset, len))
    }

    /// [`Device::cache`], waiting as `W` does.
    pub async fn cache_in<W: Waits>(&self, offset: u64, len: u64) -> Result<(), DeviceError> {
        let mut scratch = Vec::new();
        for (o, l) in steps(offset, len) {
            let pages: Vec<u64> = pages_of(o, l).map(|(p, _, _)| p).collect();
            W::read_pages(&self.inner, &pages, &mut scratch).await?;
        }
        Ok(())
    }

    /// base:allocation extents of the range: (length, NBD_STATE_* flags), at most `max` of them.
    pub fn block_status(&self, offset: u64, len: u64, max: usize) -> Vec<(u32, u32)> {
        let pager = self.pager();
        let mut extents: Vec<(u32, u32)> = Vec::new();
        for (p, start, stop) in pages_of(offset, len) {
            let flags = if pager.is_written(p) {
                0
            } else {
                crate::wire::STATE_HOLE | crate::wire::STATE_ZERO
            };
            let n = (stop - start) as u32;
            let full = extents.len() == max;
            match extents.last_mut() {
                Some((l, f)) if *f == flags && l.checked_add(n).is_some() => *l += n,
                _ if full => break,
                _ => extents.push((n, flags)),
            }
        }
        extents
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use netram_pager::{Backing, MemDisk, PagerConfig, ServerInfo, TransportError};
    use netram_proto::{Reply, Request};
    use proptest::prelude::*;

    /// No servers at all: with `disk` backing the pager never calls it.
    struct NoServers;
    impl Transport for NoServers {
        fn servers(&self) -> Vec<ServerInfo> {
            Vec::new()
        }
        fn send(&mut self, _: usize, _: u64, _: &Request<'_>) -> Result<(), TransportError> {
            unreachable!("no servers")
        }
        fn recv(&mut self, _: usize) -> Result<(u64, Reply<'_>), TransportError> {
            unreachable!("no servers")
        }
    }

    const SIZE: u64 = 16 * PAGE;

    fn device(cache_pages: usize) -> Device<NoServers, MemDisk> {
        let cfg = PagerConfig {
            pages: SIZE / PAGE,
            cache_pages,
            backing: Backing::Disk,
            ..Default::default()
        };
        Device::new(Pager::new(cfg, NoServers, MemDisk::default()), SIZE)
    }

    #[test]
    fn ranges_split_into_pages() {
        let v: Vec<_> = pages_of(100, 5000).collect();
        assert_eq!(v, vec![(0, 100, 4096), (1, 0, 1004)]);
        let v: Vec<_> = pages_of(4096, 8192).collect();
        assert_eq!(v, vec![(1, 0, 4096), (2, 0, 4096)]);
        assert_eq!(pages_of(7, 0).count(), 0);
        let v: Vec<_> = pages_of(4095, 2).collect();
        assert_eq!(v, vec![(0, 4095, 4096), (1, 0, 1)]);
    }

    #[test]
    fn zero_pages_are_not_stored() {
        let d = device(0);
        d.write(0, &[9u8; 3 * PAGE_SIZE], false).unwrap();
        d.write(PAGE, &[0u8; PAGE_SIZE], false).unwrap();
        d.write_zeroes(2 * PAGE + 10, PAGE - 10, false).unwrap();
        let written: Vec<bool> = d.with_pager(|p| (0..4).map(|pg| p.is_written(pg)).collect());
        assert_eq!(written, vec![true, false, true, false]);
        assert_eq!(
            d.block_status(0, 4 * PAGE, 16).len(),
            4,
            "data, hole, data, hole"
        );
    }

    /// A write with FUA stores its own pages before it returns and leaves the rest of the
    /// cache dirty (before, it flushed the whole cache): whole pages, and a partial page
    /// (read-modify-write).
    #[test]
    fn a_fua_write_stores_its_own_pages_only() {
        let d = device(8);
        d.write(0, &[1u8; 4 * PAGE_SIZE], false).unwrap();
        let dirty = |d: &Device<NoServers, MemDisk>| d.with_pager(|p| p.start_flush().pages_left());
        assert_eq!(dirty(&d), 4);
        d.write(5 * PAGE, &[2u8; PAGE_SIZE], true).unwrap();
        assert_eq!(
            dirty(&d),
            4,
            "the earlier pages are still dirty, page 5 is not"
        );
        d.write(6 * PAGE + 100, &[3u8; 200], true).unwrap();
        assert_eq!(dirty(&d), 4, "page 6 is stored too");
        for page in [5, 6] {
            assert!(
                d.with_pager(|p| p.location(page).is_some_and(|l| l.on_disk)),
                "page {page} is on its backing"
            );
        }
        d.flush().unwrap();
        assert_eq!(dirty(&d), 0);
        let mut got = vec![0u8; 7 * PAGE_SIZE];
        d.read(0, &mut got).unwrap();
        assert!(got[..4 * PAGE_SIZE].iter().all(|&b| b == 1));
        assert!(got[5 * PAGE_SIZE..6 * PAGE_SIZE].iter().all(|&b| b == 2));
        let six = &got[6 * PAGE_SIZE..];
        assert!(six[..100].iter().all(|&b| b == 0) && six[100..300].iter().all(|&b| b == 3));
    }

    /// Connections writing different sectors of the same pages at once, with a cache of two
    /// pages that their read-modify-writes keep evicting from under each other, and with no
    /// cache (every partial page read by ticket and merged only if still current): no sector
    /// written is lost to another connection's write of the same page.
    #[test]
    fn concurrent_partial_writes_of_one_page_lose_no_sector() {
        for cache in [2, 0] {
            concurrent_partial_writes(cache);
        }
    }

    fn concurrent_partial_writes(cache: usize) {
        let d = std::sync::Arc::new(device(cache));
        let sectors = (4 * PAGE / 512) as usize;
        let threads: Vec<_> = (0..4u8)
            .map(|t| {
                let d = d.clone();
                std::thread::spawn(move || {
                    for round in 0..20u8 {
                        for s in (t as usize..sectors).step_by(4) {
                            let byte = 1 + t + 4 * (round % 8);
                            d.write(s as u64 * 512, &[byte; 512], false).unwrap();
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let mut got = vec![0u8; 4 * PAGE_SIZE];
        d.read(0, &mut got).unwrap();
        for (s, sector) in got.chunks(512).enumerate() {
            let want = 1 + (s % 4) as u8 + 4 * (19 % 8);
            assert!(
                sector.iter().all(|&b| b == want),
                "cache {cache}, sector {s}: {:?}, not {want}",
                &sector[..4]
            );
        }
    }

    proptest! {
        /// Batches of overlapping, unaligned writes and zeroings read back exactly as applying
        /// them one by one to a plain buffer would.
        #[test]
        fn batched_writes_match_a_model(
            batches in prop::collection::vec(
                prop::collection::vec((0u64..SIZE - 1, 1u64..3 * PAGE, any::<u8>(), any::<bool>()), 1..6),
                1..6),
            cache in 0usize..4,
        ) {
            let d = device(cache);
            let mut model = vec![0u8; SIZE as usize];
            for batch in batches {
                let mut writes: Vec<(u64, Vec<u8>)> = Vec::new();
                for (offset, len, byte, zero) in batch {
                    let len = len.min(SIZE - offset);
                    let fill = if zero { 0 } else { byte };
                    model[offset as usize..(offset + len) as usize].fill(fill);
                    writes.push((offset, vec![fill; len as usize]));
                }
                let refs: Vec<(u64, &[u8])> = writes.iter().map(|(o, v)| (*o, v.as_slice())).collect();
                d.write_many(&refs, false).unwrap();
                let mut got = vec![0u8; SIZE as usize];
                d.read(0, &mut got).unwrap();
                prop_assert!(got == model);
            }
        }
    }
}
