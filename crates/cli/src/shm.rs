//! `netram shm`: segments of memory shared between machines (MIRAGE+; issue 40), from the
//! shell. A segment lives in the daemons (its creator's is its library), not in a process:
//! it stays after the process that created it exits, like a System V segment.

use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use netram_shm::Segment;
use std::io::{Read, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

#[derive(Debug, Args)]
pub struct ShmArgs {
    /// The daemon's control socket; its shared-memory socket is beside it (PATH with the
    /// extension .shm.sock) [default: $NETRAM_DAEMON, or /run/netram/7077.sock as root].
    #[arg(long, value_name = "PATH", global = true)]
    daemon: Option<String>,
    #[command(subcommand)]
    command: ShmCommand,
}

#[derive(Debug, Subcommand)]
enum ShmCommand {
    /// Create a segment of SIZE bytes called NAME, every byte zero; this machine's daemon is
    /// its library site.
    Create {
        name: String,
        /// Its size (4096, 64K, 1G …), rounded up to pages.
        #[arg(value_parser = parse_size)]
        size: u64,
        /// The time window Δ: how long a machine keeps a page it got before it must give it
        /// up (MIRAGE+ §2.1; 0 allowed, the page still goes only after it was used).
        #[arg(long, default_value = "0", value_parser = humantime::parse_duration)]
        window: Duration,
        /// Permission bits, octal, as System V's (owner and others; read and write go
        /// together).
        #[arg(long, default_value = "600")]
        mode: String,
        /// The only nodes that may attach it (ids, comma-separated) [default: every member].
        #[arg(long, value_delimiter = ',')]
        nodes: Option<Vec<u64>>,
    },
    /// Write standard input into segment NAME at OFFSET.
    Write {
        name: String,
        #[arg(long, default_value = "0", value_parser = parse_size)]
        offset: u64,
    },
    /// Copy LEN bytes of segment NAME from OFFSET to standard output [default: to its end].
    Cat {
        name: String,
        #[arg(long, default_value = "0", value_parser = parse_size)]
        offset: u64,
        #[arg(long, value_parser = parse_size)]
        len: Option<u64>,
    },
    /// Run an unmodified program with its System V shared memory and semaphores (shmget,
    /// shmat, semget, semop …) on netram: processes on different machines that use the same
    /// key share the same segment, coherently. Key K is segment "sysv:K" (semaphores
    /// "sysv-sem:K"); `netram shm cat sysv:K` shows one. Dynamically linked programs only;
    /// SEM_UNDO is not undone at exit (docs/limits.md).
    /// Exits with the program's status.
    Run {
        /// The program and its arguments (after `--`).
        #[arg(trailing_var_arg = true, required = true, value_name = "PROGRAM")]
        command: Vec<String>,
    },
    /// A check for tests: OPS random operations on WORDS words of segment NAME (two words a
    /// page, so that pages move and a page's other word changes under a reader): one in
    /// three adds one, the rest load. A word only grows, so a load below what this process
    /// saw before is a stale read (exit 1). Prints the additions made to each word (JSON), for
    /// the caller to check that the final values count every one.
    #[command(hide = true)]
    Check {
        name: String,
        #[arg(long)]
        seed: u64,
        #[arg(long)]
        ops: u64,
        #[arg(long, default_value = "8")]
        words: usize,
    },
    /// A check for tests and demonstrations: PARTIES processes (on any machines) take turns
    /// adding one to a counter at word SLOT of segment NAME, this one when the counter is
    /// TURN modulo PARTIES, ROUNDS times; prints the counter at the end.
    #[command(hide = true)]
    Turns {
        name: String,
        #[arg(long)]
        parties: u64,
        #[arg(long)]
        turn: u64,
        #[arg(long)]
        rounds: u64,
        #[arg(long, default_value = "0")]
        slot: usize,
        #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
        timeout: Duration,
    },
}

fn parse_size(s: &str) -> Result<u64, String> {
    parse_size::parse_size(s).map_err(|e| e.to_string())
}

fn socket(daemon: Option<String>) -> PathBuf {
    let control = daemon.unwrap_or_else(netram_client::discover::daemon_addr);
    netram_shm::local::socket_of(std::path::Path::new(&control))
}

/// Where the segment's bytes from `offset`, `len` of them, are, checked against its size.
fn range(seg: &Segment, offset: u64, len: u64) -> anyhow::Result<*mut u8> {
    let end = offset
        .checked_add(len)
        .context("offset and length overflow")?;
    if end > seg.len() as u64 {
        bail!(
            "{offset}+{len} is past the segment's end ({} bytes)",
            seg.len()
        );
    }
    // SAFETY: `offset` is inside the mapping (checked above).
    Ok(unsafe { seg.as_ptr().add(offset as usize) })
}

pub fn run(args: ShmArgs) -> anyhow::Result<()> {
    if let ShmCommand::Run { command } = &args.command {
        return run_program(args.daemon.as_deref(), command);
    }
    let sock = socket(args.daemon);
    match args.command {
        ShmCommand::Run { .. } => unreachable!("handled above"),
        ShmCommand::Create {
            name,
            size,
            window,
            mode,
            nodes,
        } => {
            let mode = u16::from_str_radix(&mode, 8)
                .ok()
                .filter(|m| *m <= 0o777)
                .with_context(|| format!("--mode {mode}: octal permission bits, e.g. 600"))?;
            let window = u32::try_from(window.as_millis()).context("--window too long")?;
            let seg = Segment::create(&sock, &name, size, window, mode, nodes)?;
            println!("{name}: {} bytes, segment {:x}", seg.len(), seg.id());
        }
        ShmCommand::Write { name, offset } => {
            let seg = Segment::attach(&sock, &name)?;
            let mut data = Vec::new();
            std::io::stdin().read_to_end(&mut data)?;
            let at = range(&seg, offset, data.len() as u64)?;
            // SAFETY: `data.len()` bytes from `at` are inside the live mapping (checked).
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), at, data.len()) };
        }
        ShmCommand::Cat { name, offset, len } => {
            let seg = Segment::attach(&sock, &name)?;
            let len = len.unwrap_or((seg.len() as u64).saturating_sub(offset));
            let at = range(&seg, offset, len)?;
            // Through a copy: the write(2) of a page not here would fault inside the kernel,
            // which an ordinary user's userfaultfd does not serve.
            let mut copy = vec![0u8; len as usize];
            // SAFETY: `len` bytes from `at` are inside the live mapping (checked).
            unsafe { std::ptr::copy_nonoverlapping(at, copy.as_mut_ptr(), copy.len()) };
            std::io::stdout().write_all(&copy)?;
        }
        ShmCommand::Check {
            name,
            seed,
            ops,
            words,
        } => {
            let seg = Segment::attach(&sock, &name)?;
            let stride = netram_proto::PAGE_SIZE / 2;
            range(&seg, 0, (words * stride) as u64)?;
            // SAFETY: word i is at i · stride, inside the live mapping (checked above),
            // aligned, used only atomically while `seg` is held.
            let word = |i: usize| unsafe { &*(seg.as_ptr().add(i * stride) as *const AtomicU64) };
            let mut rng = fastrand::Rng::with_seed(seed);
            let mut seen = vec![0u64; words];
            let mut added = vec![0u64; words];
            for op in 0..ops {
                let i = rng.usize(..words);
                let v = if rng.u8(..3) == 0 {
                    added[i] += 1;
                    word(i).fetch_add(1, Ordering::SeqCst) + 1
                } else {
                    word(i).load(Ordering::SeqCst)
                };
                if v < seen[i] {
                    bail!(
                        "operation {op}: word {i} read {v} after {}: a stale read",
                        seen[i]
                    );
                }
                seen[i] = v;
            }
            println!("{}", serde_json::json!({ "added": added }));
        }
        ShmCommand::Turns {
            name,
            parties,
            turn,
            rounds,
            slot,
            timeout,
        } => {
            if parties == 0 || turn >= parties {
                bail!("--turn must be below --parties");
            }
            let seg = Segment::attach(&sock, &name)?;
            let at = range(&seg, slot as u64 * 8, 8)?;
            // SAFETY: an aligned word inside the live mapping (page-aligned, checked), used
            // only atomically while `seg` is held.
            let word = unsafe { &*(at as *const AtomicU64) };
            let deadline = Instant::now() + timeout;
            for _ in 0..rounds {
                loop {
                    let v = word.load(Ordering::SeqCst);
                    if v % parties == turn {
                        word.store(v + 1, Ordering::SeqCst);
                        break;
                    }
                    if Instant::now() > deadline {
                        bail!("stuck: the counter is {v}, waiting for {turn} mod {parties}");
                    }
                    std::hint::spin_loop();
                }
            }
            println!("{}", word.load(Ordering::SeqCst));
        }
    }
    Ok(())
}

/// `netram shm run`: the program with the System V preload library, in place of this process.
fn run_program(daemon: Option<&str>, command: &[String]) -> anyhow::Result<()> {
    use std::os::unix::process::CommandExt;
    let lib = crate::run::library("libnetram_sysv.so", "NETRAM_SYSV", "netram-sysv")?;
    if let Some(why) = crate::run::cannot_attach(&command[0]) {
        bail!(
            "{} cannot use netram's shared memory: {why}; netram shm run reaches a program \
             through the dynamic loader (LD_PRELOAD)",
            command[0]
        );
    }
    // The daemon must answer before the program starts: a missing daemon is said here, once.
    let control = daemon
        .map(str::to_owned)
        .unwrap_or_else(netram_client::discover::daemon_addr);
    let sock = netram_shm::local::socket_of(std::path::Path::new(&control));
    match std::os::unix::net::UnixStream::connect(&sock) {
        // A SEQPACKET socket refuses a stream connection with EPROTOTYPE: it is there.
        Ok(_) => {}
        Err(e) if e.raw_os_error() == Some(libc::EPROTOTYPE) => {}
        Err(e) => {
            return Err(e).with_context(|| {
                format!(
                    "no netram daemon's shared-memory socket at {}",
                    sock.display()
                )
            })
        }
    }
    let preload = match std::env::var("LD_PRELOAD") {
        Ok(old) if !old.is_empty() => format!("{}:{old}", lib.display()),
        _ => lib.display().to_string(),
    };
    let err = std::process::Command::new(&command[0])
        .args(&command[1..])
        .env("LD_PRELOAD", preload)
        .env("NETRAM_DAEMON", &control)
        .exec();
    bail!("cannot run {}: {err}", command[0])
}
