//! Bayesian optimisation over the unit cube (one or two dimensions): a Gaussian process models the score,
//! and the next point is the one with the largest expected improvement over the best predicted score.
//!
//! The acquisition function is maximised by evaluating it on a grid and then on a finer grid around the
//! grid's best point: deterministic, and cheap for the one or two dimensions tuned here.

use crate::autotune::gaussian_process::GaussianProcess;

/// Exploration margin of the expected improvement, in units of the scores' spread (as Horovod's `xi`).
const XI: f64 = 0.01;
/// Coarse grid points per dimension, and the refinement grid's.
const COARSE: usize = 33;
const FINE: usize = 11;

/// The next point to try and the expected improvement that chose it (in the scores' units).
#[derive(Clone, Debug, PartialEq)]
pub struct Proposal {
    pub x: Vec<f64>,
    pub expected_improvement: f64,
}

pub struct BayesianOptimizer {
    dims: usize,
    noise: f64,
    xs: Vec<Vec<f64>>,
    ys: Vec<f64>,
}

/// Standard normal density and distribution.
fn pdf(z: f64) -> f64 {
    (-0.5 * z * z).exp() / (2.0 * std::f64::consts::PI).sqrt()
}

fn cdf(z: f64) -> f64 {
    0.5 * erfc(-z / std::f64::consts::SQRT_2)
}

/// Complementary error function (Numerical Recipes' Chebyshev fit, relative error below 1.2e-7).
fn erfc(x: f64) -> f64 {
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -z * z - 1.265_512_23
        + t * (1.000_023_68
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06
                        + t * (0.278_868_07
                            + t * (-1.135_203_98 + t * (1.488_515_87 + t * (-0.822_152_23 + t * 0.170_872_77))))))));
    let r = t * poly.exp();
    if x >= 0.0 {
        r
    } else {
        2.0 - r
    }
}

/// Every point of a grid with `per_dim` points per dimension spanning `[lo, hi]` (clamped to the unit cube).
fn grid(dims: usize, per_dim: usize, lo: &[f64], hi: &[f64]) -> Vec<Vec<f64>> {
    let mut points = vec![Vec::with_capacity(dims)];
    for d in 0..dims {
        let (a, b) = (lo[d].max(0.0), hi[d].min(1.0));
        let steps = (per_dim.max(2) - 1) as f64;
        points = points
            .into_iter()
            .flat_map(|p| {
                (0..per_dim.max(2)).map(move |i| {
                    let mut q = p.clone();
                    q.push(a + (b - a) * i as f64 / steps);
                    q
                })
            })
            .collect();
    }
    points
}

impl BayesianOptimizer {
    pub fn new(dims: usize, noise: f64) -> Self {
        BayesianOptimizer { dims, noise, xs: Vec::new(), ys: Vec::new() }
    }

    pub fn add_sample(&mut self, x: Vec<f64>, y: f64) {
        self.xs.push(x);
        self.ys.push(y);
    }

    pub fn samples(&self) -> usize {
        self.ys.len()
    }

    /// The best sample so far: its point and score.
    pub fn best(&self) -> Option<(&[f64], f64)> {
        self.xs.iter().zip(&self.ys).max_by(|a, b| a.1.total_cmp(b.1)).map(|(x, y)| (x.as_slice(), *y))
    }

    /// The sampled point the model predicts best, and that prediction: with noisy samples the luckiest
    /// measurement is an optimistic pick (of 20 samples whose noise exceeds the knobs' effect, the highest is
    /// mostly noise), while the model's mean there also weighs the samples around it. The best sample where
    /// no model can be fitted.
    pub fn best_predicted(&self) -> Option<(Vec<f64>, f64)> {
        let Some(gp) = GaussianProcess::fit(&self.xs, &self.ys, self.noise) else {
            return self.best().map(|(x, y)| (x.to_vec(), y));
        };
        self.xs.iter().map(|x| (x.clone(), gp.predict(x).0)).max_by(|a, b| a.1.total_cmp(&b.1))
    }

    /// The point with the largest expected improvement; `None` before the first sample.
    pub fn propose(&self) -> Option<Proposal> {
        let gp = GaussianProcess::fit(&self.xs, &self.ys, self.noise)?;
        // With noisy samples the best *predicted* score is the incumbent, not the luckiest measurement.
        let incumbent = self.xs.iter().map(|x| gp.predict(x).0).fold(f64::NEG_INFINITY, f64::max);
        let spread = {
            let mean = self.ys.iter().sum::<f64>() / self.ys.len() as f64;
            let var = self.ys.iter().map(|y| (y - mean) * (y - mean)).sum::<f64>() / self.ys.len() as f64;
            if var > 0.0 {
                var.sqrt()
            } else {
                1.0
            }
        };
        let ei = |x: &[f64]| {
            let (mu, sigma) = gp.predict(x);
            let improvement = mu - incumbent - XI * spread;
            if sigma <= 0.0 {
                return improvement.max(0.0);
            }
            let z = improvement / sigma;
            improvement * cdf(z) + sigma * pdf(z)
        };
        let best_of = |points: Vec<Vec<f64>>| {
            points.into_iter().map(|x| (ei(&x), x)).fold(None::<(f64, Vec<f64>)>, |best, (v, x)| match best {
                Some((b, _)) if b >= v => best,
                _ => Some((v, x)),
            })
        };
        let (zeros, ones) = (vec![0.0; self.dims], vec![1.0; self.dims]);
        let (coarse_ei, coarse) = best_of(grid(self.dims, COARSE, &zeros, &ones))?;
        let step = 1.0 / (COARSE - 1) as f64;
        let lo: Vec<f64> = coarse.iter().map(|c| c - step).collect();
        let hi: Vec<f64> = coarse.iter().map(|c| c + step).collect();
        let (fine_ei, fine) = best_of(grid(self.dims, FINE, &lo, &hi))?;
        let (expected_improvement, x) = if fine_ei > coarse_ei { (fine_ei, fine) } else { (coarse_ei, coarse) };
        Some(Proposal { x, expected_improvement })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A smooth bump with its maximum 1000 at `peak`, falling to about 700 at the cube's far corners.
    fn bump(x: &[f64], peak: &[f64]) -> f64 {
        let d2: f64 = x.iter().zip(peak).map(|(a, b)| (a - b) * (a - b)).sum();
        700.0 + 300.0 * (-d2 / 0.15).exp()
    }

    fn optimise(peak: &[f64], starts: &[Vec<f64>], budget: usize, noise: f64) -> (Vec<f64>, f64) {
        let mut opt = BayesianOptimizer::new(peak.len(), noise);
        for x in starts {
            opt.add_sample(x.clone(), bump(x, peak));
        }
        while opt.samples() < budget {
            let next = opt.propose().unwrap();
            assert!(next.x.iter().all(|v| (0.0..=1.0).contains(v)), "stays in the cube: {:?}", next.x);
            assert!(next.expected_improvement >= 0.0);
            let y = bump(&next.x, peak);
            opt.add_sample(next.x, y);
        }
        let (x, y) = opt.best().unwrap();
        (x.to_vec(), y)
    }

    #[test]
    fn finds_the_maximum_of_a_smooth_two_dimensional_function() {
        let starts = vec![vec![0.06, 0.35], vec![0.5, 0.85], vec![0.25, 0.7], vec![0.12, 0.5]];
        for peak in [[0.8, 0.2], [0.3, 0.6], [0.95, 0.95]] {
            let (x, y) = optimise(&peak, &starts, 20, 0.05);
            let distance = ((x[0] - peak[0]).powi(2) + (x[1] - peak[1]).powi(2)).sqrt();
            assert!(y > 990.0 && distance < 0.1, "peak {peak:?}: best {x:?} scored {y} ({distance} away)");
        }
    }

    #[test]
    fn finds_the_maximum_in_one_dimension() {
        let (x, y) = optimise(&[0.7], &[vec![0.1], vec![0.4]], 10, 0.05);
        assert!((x[0] - 0.7).abs() < 0.05 && y > 995.0, "best {x:?} scored {y}");
    }

    #[test]
    fn the_best_predicted_point_is_not_a_lucky_outlier() {
        // Scores peak around 0.7; one sample at 0.05, between two poor ones, measured high by luck.
        let mut opt = BayesianOptimizer::new(1, 0.8);
        for (x, y) in [
            (0.0, 700.0),
            (0.05, 1060.0),
            (0.1, 690.0),
            (0.4, 850.0),
            (0.6, 980.0),
            (0.65, 1010.0),
            (0.7, 1020.0),
            (0.75, 1000.0),
            (0.9, 900.0),
        ] {
            opt.add_sample(vec![x], y);
        }
        assert_eq!(opt.best().map(|(x, _)| x[0]), Some(0.05), "the luckiest sample");
        let (x, predicted) = opt.best_predicted().unwrap();
        assert!((0.6..=0.75).contains(&x[0]), "picked {x:?} (predicted {predicted})");
        assert!(predicted < 1060.0);
        // Without a model (no finite scores to fit), the best sample.
        let mut lone = BayesianOptimizer::new(1, 0.8);
        lone.add_sample(vec![0.3], f64::NAN);
        assert!(lone.best_predicted().is_some_and(|(x, y)| x == [0.3] && y.is_nan()));
    }

    #[test]
    fn normal_distribution_matches_known_values() {
        assert!((cdf(0.0) - 0.5).abs() < 1e-7);
        assert!((cdf(1.959_964) - 0.975).abs() < 1e-6);
        assert!((cdf(-1.0) - 0.158_655_25).abs() < 1e-6);
        assert!((pdf(0.0) - 0.398_942_28).abs() < 1e-8);
    }

    #[test]
    fn proposes_nothing_without_samples() {
        assert_eq!(BayesianOptimizer::new(2, 0.8).propose(), None);
    }
}
