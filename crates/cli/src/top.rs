//! `netram top`: a live view of the cluster for an operator, from this machine's daemon (its
//! control socket: `/members` for what it believes of every member, `/metrics` for its own
//! counters), refreshed every second: who is alive, what each member offers and how much of
//! it is used, and what this daemon is doing (pages stored and read per second, refusals).
//! The membership it shows is SWIM's (Nswap §3's idle-memory picture, kept by every daemon).
//!
//! Drawing is a pure function of two samples ([`draw`]), so `--once` renders the same frame
//! into a buffer and prints it: for scripts, and for a terminal-less check of what it shows.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use netram_member::{Liveness, MemberList};
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Borders, Cell, Paragraph, Row, Table};
use ratatui::Frame;

#[derive(Debug, clap::Args)]
pub struct TopArgs {
    /// The daemon's control socket [default: $NETRAM_DAEMON, or /run/netram/7077.sock as
    /// root].
    #[arg(long, value_name = "PATH")]
    daemon: Option<String>,
    /// How often to refresh (rates are per second over this interval).
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    interval: Duration,
    /// Print one frame (two samples one interval apart) as text and exit: for scripts and
    /// terminals that cannot show the live view.
    #[arg(long)]
    once: bool,
    /// The width of the frame --once prints [default: $COLUMNS, or 120].
    #[arg(long, value_name = "COLUMNS")]
    width: Option<u16>,
    /// How long to wait for the daemon at each refresh.
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    timeout: Duration,
}

/// What the daemon said at one moment (or why it said nothing).
struct Sample {
    at: Instant,
    members: Result<MemberList, String>,
    metrics: Result<HashMap<String, f64>, String>,
}

fn sample(daemon: &str, timeout: Duration) -> Sample {
    let members = netram_client::discover::members(daemon, timeout).map_err(|e| e.to_string());
    let metrics = netram_client::discover::metrics(daemon, timeout)
        .map(|text| parse_metrics(&text))
        .map_err(|e| e.to_string());
    Sample {
        at: Instant::now(),
        members,
        metrics,
    }
}

/// Prometheus' text format: `name{labels} value` per line, `#` comments. Series are keyed
/// by everything before the value.
fn parse_metrics(text: &str) -> HashMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (name, value) = l.rsplit_once(' ')?;
            Some((name.trim().to_owned(), value.trim().parse().ok()?))
        })
        .collect()
}

pub fn run(args: TopArgs) -> Result<()> {
    let daemon = args
        .daemon
        .clone()
        .unwrap_or_else(netram_client::discover::daemon_addr);
    if args.interval < Duration::from_millis(100) {
        bail!("--interval: at least 100ms");
    }
    if args.once {
        return once(&args, &daemon);
    }
    use std::io::IsTerminal;
    if !std::io::stdout().is_terminal() {
        bail!("netram top draws on a terminal; --once prints one frame as text");
    }
    // Said before the screen is taken over, if the daemon cannot be asked at all.
    let mut now = sample(&daemon, args.timeout);
    if let Err(e) = &now.members {
        bail!("{e}");
    }
    let mut terminal = ratatui::init();
    let result = (|| -> Result<()> {
        // Rates from the second frame on (the first has nothing to compare with).
        let mut before: Option<Sample> = None;
        loop {
            terminal.draw(|f| draw(f, &daemon, args.interval, &now, before.as_ref()))?;
            let next = now.at + args.interval;
            while let Some(left) = next.checked_duration_since(Instant::now()) {
                if ratatui::crossterm::event::poll(left)?
                    && quits(&ratatui::crossterm::event::read()?)
                {
                    return Ok(());
                }
            }
            before = Some(std::mem::replace(&mut now, sample(&daemon, args.timeout)));
        }
    })();
    ratatui::restore();
    result
}

/// q, Esc or Ctrl-C.
fn quits(event: &ratatui::crossterm::event::Event) -> bool {
    use ratatui::crossterm::event::{Event, KeyCode, KeyEventKind, KeyModifiers};
    let Event::Key(k) = event else {
        return false;
    };
    k.kind == KeyEventKind::Press
        && (matches!(k.code, KeyCode::Char('q') | KeyCode::Esc)
            || (k.code == KeyCode::Char('c') && k.modifiers.contains(KeyModifiers::CONTROL)))
}

fn once(args: &TopArgs, daemon: &str) -> Result<()> {
    let before = sample(daemon, args.timeout);
    if let Err(e) = &before.members {
        bail!("{e}");
    }
    std::thread::sleep(args.interval);
    let now = sample(daemon, args.timeout);
    let width = args
        .width
        .or_else(|| std::env::var("COLUMNS").ok()?.parse().ok())
        .unwrap_or(120)
        .max(60);
    let rows = now.members.as_ref().map_or(0, |m| m.members.len()) as u16;
    let height = 5 + (rows + 3) + 10;
    let mut terminal = ratatui::Terminal::new(ratatui::backend::TestBackend::new(width, height))?;
    terminal.draw(|f| draw(f, daemon, args.interval, &now, Some(&before)))?;
    let buffer = terminal.backend().buffer();
    let lines: Vec<String> = (0..buffer.area.height)
        .map(|y| {
            let line: String = (0..buffer.area.width)
                .map(|x| buffer[(x, y)].symbol())
                .collect();
            line.trim_end().to_owned()
        })
        .collect();
    let end = lines
        .iter()
        .rposition(|l| !l.is_empty())
        .map_or(0, |i| i + 1);
    for line in &lines[..end] {
        println!("{line}");
    }
    Ok(())
}

fn mib(pages: u64) -> String {
    let bytes = pages * 4096;
    if bytes >= 10 << 30 {
        format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
    } else {
        format!("{} MiB", bytes >> 20)
    }
}

/// A bar of `width` cells, `used` of `total` filled.
fn bar(used: u64, total: u64, width: usize) -> String {
    let filled = if total == 0 {
        0
    } else {
        ((used as f64 / total as f64) * width as f64).round() as usize
    }
    .min(width);
    format!("{}{}", "█".repeat(filled), "·".repeat(width - filled))
}

/// One frame: the cluster's totals, a row per member, this daemon's counters and rates
/// (`before`: the previous sample, for per-second rates).
fn draw(f: &mut Frame, daemon: &str, interval: Duration, now: &Sample, before: Option<&Sample>) {
    let rows = now.members.as_ref().map_or(1, |m| m.members.len().max(1)) as u16;
    let [head, table, own] = Layout::vertical([
        Constraint::Length(4),
        Constraint::Length(rows + 3),
        Constraint::Min(10),
    ])
    .areas(f.area());
    draw_head(f, head, daemon, interval, now);
    draw_members(f, table, now);
    draw_own(f, own, now, before);
}

fn draw_head(f: &mut Frame, area: Rect, daemon: &str, interval: Duration, now: &Sample) {
    let title = Line::from(vec![
        Span::styled("netram top", Style::new().add_modifier(Modifier::BOLD)),
        Span::raw(format!(
            "  daemon {daemon}, every {}  (q quits)",
            humantime::format_duration(interval)
        )),
    ]);
    let summary = match &now.members {
        Ok(list) => {
            let count = |s: Liveness| list.members.iter().filter(|m| m.state == s).count();
            let live = list.members.iter().filter(|m| m.state != Liveness::Down);
            let (offered, free, req): (u64, u64, u64) = live.fold((0, 0, 0), |(o, fr, r), m| {
                (
                    o + m.offered_pages,
                    fr + m.free_pages,
                    r + u64::from(m.requests_per_s),
                )
            });
            let used = offered.saturating_sub(free);
            Line::from(format!(
                "members: {} alive, {} suspect, {} down   offered {}   used {} ({}%)   free {}   {} req/s",
                count(Liveness::Alive),
                count(Liveness::Suspect),
                count(Liveness::Down),
                mib(offered),
                mib(used),
                (used * 100).checked_div(offered).unwrap_or(0),
                mib(free),
                req
            ))
        }
        Err(e) => Line::styled(
            format!("cannot ask the daemon: {e}"),
            Style::new().fg(Color::Red),
        ),
    };
    f.render_widget(
        Paragraph::new(vec![title, summary]).block(Block::new().borders(Borders::BOTTOM)),
        area,
    );
}

fn draw_members(f: &mut Frame, area: Rect, now: &Sample) {
    let header = Row::new(
        [
            "node", "address", "state", "offered", "used", "", "free", "req/s", "heard",
        ]
        .map(|h| Cell::from(h).style(Style::new().add_modifier(Modifier::BOLD))),
    );
    let rows: Vec<Row> = match &now.members {
        Ok(list) => list
            .members
            .iter()
            .map(|m| {
                let used = m.offered_pages.saturating_sub(m.free_pages);
                let state = format!("{:?}", m.state).to_lowercase();
                let colour = match m.state {
                    Liveness::Alive => Color::Green,
                    Liveness::Suspect => Color::Yellow,
                    Liveness::Down => Color::Red,
                };
                Row::new(vec![
                    Cell::from(format!("{}{}", if m.is_self { "*" } else { "" }, m.node)),
                    Cell::from(m.addr.to_string()),
                    Cell::from(state).style(Style::new().fg(colour)),
                    Cell::from(mib(m.offered_pages)),
                    Cell::from(mib(used)),
                    Cell::from(bar(used, m.offered_pages, 20)),
                    Cell::from(mib(m.free_pages)),
                    Cell::from(m.requests_per_s.to_string()),
                    Cell::from(m.heard_ms_ago.map_or_else(
                        || "never".into(),
                        |ms| format!("{:.1}s ago", ms as f64 / 1e3),
                    )),
                ])
            })
            .collect(),
        Err(_) => vec![Row::new(vec![Cell::from("(no answer)")])],
    };
    let widths = [
        Constraint::Length(21),
        Constraint::Length(22),
        Constraint::Length(8),
        Constraint::Length(10),
        Constraint::Length(10),
        Constraint::Length(21),
        Constraint::Length(10),
        Constraint::Length(7),
        Constraint::Length(10),
    ];
    f.render_widget(
        Table::new(rows, widths).header(header).block(
            Block::new()
                .title(" members (* this daemon) ")
                .borders(Borders::TOP),
        ),
        area,
    );
}

/// What this daemon's `/metrics` says: levels, and per-second rates of its counters.
fn draw_own(f: &mut Frame, area: Rect, now: &Sample, before: Option<&Sample>) {
    let block = Block::new().title(" this daemon ").borders(Borders::TOP);
    let m = match &now.metrics {
        Ok(m) => m,
        Err(e) => {
            f.render_widget(
                Paragraph::new(format!("no metrics: {e}")).block(block),
                area,
            );
            return;
        }
    };
    let get = |name: &str| m.get(name).copied().unwrap_or(0.0);
    let rate = |name: &str| -> String {
        let Some(b) = before.and_then(|b| b.metrics.as_ref().ok()) else {
            return "-".into();
        };
        let secs = now
            .at
            .duration_since(before.expect("checked").at)
            .as_secs_f64();
        let d = get(name) - b.get(name).copied().unwrap_or(0.0);
        if secs <= 0.0 || d < 0.0 {
            return "-".into();
        }
        format!("{:.0}", d / secs)
    };
    let stored = get("netram_stored_pages") as u64;
    let capacity = get("netram_capacity_pages") as u64;
    let lines = vec![
        Line::from(format!(
            "pages stored {} of {} {}   beyond its offer {}   connections {}   sessions {}",
            mib(stored),
            mib(capacity),
            bar(stored, capacity, 20),
            get("netram_pages_beyond_offer") as u64,
            get("netram_connections") as u64,
            get("netram_live_sessions") as u64,
        )),
        Line::from(format!(
            "per second: pages stored {}, read {}, deleted {}; requests {}",
            rate("netram_pages_stored_total"),
            rate("netram_pages_read_total"),
            rate("netram_pages_deleted_total"),
            rate("netram_requests_served_total"),
        )),
        Line::from(format!(
            "migration per second: pages handed over {}, adopted {}; its offer grew {} times, \
             shrank {} times",
            rate("netram_pages_handed_over_total"),
            rate("netram_pages_adopted_total"),
            get("netram_offer_grows_total") as u64,
            get("netram_offer_shrinks_total") as u64,
        )),
        Line::from(format!(
            "recovery: parity deltas applied per second {}, parity groups received {}, orphaned members \
             reported to their owners {}, damaged groups {}",
            rate("netram_parity_deltas_applied_total"),
            get("netram_parity_groups_shipped_total") as u64,
            get("netram_parity_orphans_reported_total") as u64,
            get("netram_parity_groups_damaged_total") as u64,
        )),
        Line::from(format!(
            "refused: puts (full) {}, puts (quota) {}, connections (busy) {}, TLS handshakes \
             failed {}, malformed frames {}, throttled requests {}",
            get("netram_puts_refused_full_total") as u64,
            get("netram_puts_refused_quota_total") as u64,
            get("netram_connections_refused_busy_total") as u64,
            get("netram_handshakes_tls_failed_total") as u64,
            get("netram_frames_rejected_malformed_total") as u64,
            get("netram_requests_throttled_total") as u64,
        )),
    ];
    f.render_widget(
        Paragraph::new(lines)
            .wrap(ratatui::widgets::Wrap { trim: false })
            .block(block),
        area,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_are_parsed_by_series() {
        let m = parse_metrics(
            "# HELP netram_stored_pages x\n# TYPE netram_stored_pages gauge\n\
             netram_stored_pages 42\nnetram_pages_read_total 7\nbad line\n\
             netram_x{kind=\"a b\"} 3.5\n",
        );
        assert_eq!(m["netram_stored_pages"], 42.0);
        assert_eq!(m["netram_pages_read_total"], 7.0);
        assert_eq!(m["netram_x{kind=\"a b\"}"], 3.5);
        assert_eq!(m.len(), 3);
    }

    #[test]
    fn bars_fill_in_proportion() {
        assert_eq!(bar(0, 0, 4), "····");
        assert_eq!(bar(1, 2, 4), "██··");
        assert_eq!(bar(9, 2, 4), "████");
    }
}
