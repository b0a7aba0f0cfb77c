//! What a sweep runs and in which order: the options (strategies, group sizes, budgets, read
//! from the environment by `main`), the jobs of a round and their order, which differs from
//! round to round.

/// Every strategy `pvisor replay --strategy` may take here, in the order of round 0, and the
/// kernel's answer: `off` with swap to zram or zswap (`swap`).
pub const STRATEGIES: [&str; 7] = [
    "off",
    "offload",
    "offload-compressed",
    "cold-compression",
    "governed",
    "off+zram",
    "off+zswap",
];

/// The group sizes the issue searches.
pub const SWEEP: [usize; 11] = [1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64];

/// Most VMs of one `pvisor replay`.
pub const MAX_VMS: usize = 64;

/// The comma-separated strategies of `text`, each one of `STRATEGIES`, none twice.
pub fn parse_strategies(text: &str) -> Result<Vec<String>, String> {
    let mut strategies: Vec<String> = Vec::new();
    for name in text.split(',').map(str::trim).filter(|n| !n.is_empty()) {
        if !STRATEGIES.contains(&name) {
            return Err(format!(
                "strategy `{name}`: expected some of {}",
                STRATEGIES.join(", ")
            ));
        }
        if strategies.iter().any(|s| s == name) {
            return Err(format!("strategy `{name}` given twice"));
        }
        strategies.push(name.to_owned());
    }
    if strategies.is_empty() {
        return Err("no strategy given".to_owned());
    }
    Ok(strategies)
}

/// The comma-separated group sizes of `text`: ascending, 1 to `MAX_VMS`.
pub fn parse_vms(text: &str) -> Result<Vec<usize>, String> {
    let mut sizes = Vec::new();
    for part in text.split(',').map(str::trim).filter(|n| !n.is_empty()) {
        let n = part
            .parse::<usize>()
            .ok()
            .filter(|n| (1..=MAX_VMS).contains(n))
            .ok_or_else(|| format!("group size `{part}`: expected 1 to {MAX_VMS}"))?;
        if sizes.last().is_some_and(|&last| n <= last) {
            return Err(format!(
                "group sizes `{text}`: expected ascending sizes (the sweep stops at the first that fails)"
            ));
        }
        sizes.push(n);
    }
    if sizes.is_empty() {
        return Err("no group size given".to_owned());
    }
    Ok(sizes)
}

/// The comma-separated budgets of `text` (`512MiB,1GiB`), each as given and in bytes.
pub fn parse_budgets(text: &str) -> Result<Vec<(String, u64)>, String> {
    let mut budgets: Vec<(String, u64)> = Vec::new();
    for part in text.split(',').map(str::trim).filter(|n| !n.is_empty()) {
        let bytes = basics::parse_size(part)
            .ok()
            .filter(|&b| b > 0)
            .ok_or_else(|| format!("budget `{part}`: expected a size such as 512MiB"))?;
        if budgets.iter().any(|(_, b)| *b == bytes) {
            return Err(format!("budget `{part}` given twice"));
        }
        budgets.push((part.to_owned(), bytes));
    }
    if budgets.is_empty() {
        return Err("no budget given".to_owned());
    }
    Ok(budgets)
}

/// One run of a round: a strategy (its index), with a budget (its index) or without.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Job {
    pub strategy: usize,
    pub budget: Option<usize>,
}

/// The jobs of one group size: for each strategy still swept, its unbudgeted run and a run
/// under each budget it is still swept at (`swept(strategy, budget)`); the unbudgeted run only
/// where some budget is. In the order of round 0: strategies in turn, the unbudgeted run
/// between its budgeted ones.
pub fn jobs(strategies: usize, budgets: usize, swept: impl Fn(usize, usize) -> bool) -> Vec<Job> {
    let mut jobs = Vec::new();
    for strategy in 0..strategies {
        let under: Vec<usize> = (0..budgets).filter(|&b| swept(strategy, b)).collect();
        let Some((&first, rest)) = under.split_first() else {
            continue;
        };
        jobs.push(Job {
            strategy,
            budget: Some(first),
        });
        jobs.push(Job {
            strategy,
            budget: None,
        });
        jobs.extend(rest.iter().map(|&b| Job {
            strategy,
            budget: Some(b),
        }));
    }
    jobs
}

/// The order of `jobs` in round `round` (from 0): rotated by the round, and reversed in odd
/// rounds, so that no job keeps its place or its neighbours from round to round; two jobs
/// alternate.
pub fn round_order(jobs: &[Job], round: usize) -> Vec<Job> {
    let mut order = jobs.to_vec();
    if order.len() < 2 {
        return order;
    }
    if order.len() == 2 {
        if round % 2 == 1 {
            order.reverse();
        }
        return order;
    }
    let shift = round % order.len();
    order.rotate_left(shift);
    if round % 2 == 1 {
        order.reverse();
    }
    order
}

#[cfg(test)]
pub mod tests {
    use super::*;

    fn parse_vms_ascending_sizes_parse() {
        assert_eq!(parse_vms("1, 2,4,64").unwrap(), vec![1, 2, 4, 64]);
        assert_eq!(
            parse_vms(&SWEEP.map(|n| n.to_string()).join(",")).unwrap(),
            SWEEP
        );
    }

    fn parse_vms_bad_sizes_are_refused() {
        for bad in ["", "0", "65", "4,2", "2,2", "x"] {
            assert!(parse_vms(bad).is_err(), "{bad}");
        }
    }

    fn parse_strategies_unknown_or_twice_is_refused() {
        assert_eq!(
            parse_strategies("off,governed").unwrap(),
            vec!["off".to_owned(), "governed".to_owned()]
        );
        assert!(parse_strategies("off,swap").is_err());
        assert!(parse_strategies("off,off").is_err());
        assert!(parse_strategies("").is_err());
    }

    fn parse_budgets_sizes_parse_in_bytes() {
        assert_eq!(
            parse_budgets("512MiB,1GiB").unwrap(),
            vec![
                ("512MiB".to_owned(), 512 << 20),
                ("1GiB".to_owned(), 1 << 30)
            ]
        );
        assert!(parse_budgets("0").is_err());
        assert!(parse_budgets("1GiB,1024MiB").is_err());
    }

    fn jobs_stopped_budgets_are_left_out() {
        // Strategy 0 swept at both budgets, 1 at budget 1 only, 2 at none.
        let jobs = jobs(3, 2, |s, b| s == 0 || (s == 1 && b == 1));
        let expected = vec![
            Job {
                strategy: 0,
                budget: Some(0),
            },
            Job {
                strategy: 0,
                budget: None,
            },
            Job {
                strategy: 0,
                budget: Some(1),
            },
            Job {
                strategy: 1,
                budget: Some(1),
            },
            Job {
                strategy: 1,
                budget: None,
            },
        ];
        assert_eq!(jobs, expected);
    }

    fn round_order_consecutive_rounds_differ_and_keep_every_job() {
        for len in 1..=12 {
            let all = jobs(len, 1, |_, _| true);
            let mut previous: Option<Vec<Job>> = None;
            for round in 0..6 {
                let order = round_order(&all, round);
                let mut sorted = order.clone();
                sorted.sort();
                let mut expected = all.clone();
                expected.sort();
                assert_eq!(sorted, expected, "len {len} round {round}");
                if let Some(previous) = &previous {
                    assert_ne!(&order, previous, "len {len} round {round}");
                }
                previous = Some(order);
            }
        }
    }

    fn round_order_three_rounds_all_differ() {
        // Two strategies, two budgets: six jobs.
        let all = jobs(2, 2, |_, _| true);
        let orders: Vec<Vec<Job>> = (0..3).map(|r| round_order(&all, r)).collect();
        assert_ne!(orders[0], orders[1]);
        assert_ne!(orders[1], orders[2]);
        assert_ne!(orders[0], orders[2]);
    }

    pub const ALL: &[(&str, fn())] = &[
        (
            "parse_vms_ascending_sizes_parse",
            parse_vms_ascending_sizes_parse,
        ),
        (
            "parse_vms_bad_sizes_are_refused",
            parse_vms_bad_sizes_are_refused,
        ),
        (
            "parse_strategies_unknown_or_twice_is_refused",
            parse_strategies_unknown_or_twice_is_refused,
        ),
        (
            "parse_budgets_sizes_parse_in_bytes",
            parse_budgets_sizes_parse_in_bytes,
        ),
        (
            "jobs_stopped_budgets_are_left_out",
            jobs_stopped_budgets_are_left_out,
        ),
        (
            "round_order_consecutive_rounds_differ_and_keep_every_job",
            round_order_consecutive_rounds_differ_and_keep_every_job,
        ),
        (
            "round_order_three_rounds_all_differ",
            round_order_three_rounds_all_differ,
        ),
    ];
}
