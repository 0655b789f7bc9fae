//! Gaussian-process regression over points of the unit cube: the autotuner's model of how the score
//! depends on the knobs it tunes.
//!
//! Scores are standardised (mean 0, variance 1) before fitting, so the kernel's signal variance is 1 and the
//! noise knob (`RVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE`) is the measurement noise's standard deviation in units
//! of the scores' spread. The kernel is a squared exponential whose length scale is the one of a short list
//! that maximises the data's log marginal likelihood: with at most a few dozen samples a list is as good as
//! a gradient search and cannot fail to converge. The Cholesky factorisation is nalgebra's.

use nalgebra::{Cholesky, DMatrix, DVector, Dyn};

/// Length scales tried when fitting (the inputs live in the unit cube).
const LENGTH_SCALES: [f64; 9] = [0.05, 0.08, 0.12, 0.18, 0.25, 0.35, 0.5, 0.7, 1.0];

/// Added to the diagonal so the factorisation succeeds even with no noise and repeated points.
const JITTER: f64 = 1e-8;

/// A fitted model: predicts the score's mean and standard deviation anywhere in the unit cube.
pub struct GaussianProcess {
    xs: Vec<Vec<f64>>,
    length_scale: f64,
    factor: Cholesky<f64, Dyn>,
    /// `K^-1 y` for the standardised scores.
    weights: DVector<f64>,
    y_mean: f64,
    y_scale: f64,
}

fn kernel(a: &[f64], b: &[f64], length_scale: f64) -> f64 {
    let d2: f64 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
    (-0.5 * d2 / (length_scale * length_scale)).exp()
}

impl GaussianProcess {
    /// Fit to the samples `(xs[i], ys[i])`; `None` without samples or when the numbers are not finite.
    pub fn fit(xs: &[Vec<f64>], ys: &[f64], noise: f64) -> Option<GaussianProcess> {
        if xs.is_empty() || xs.len() != ys.len() || ys.iter().any(|y| !y.is_finite()) {
            return None;
        }
        let n = ys.len();
        let y_mean = ys.iter().sum::<f64>() / n as f64;
        let variance = ys.iter().map(|y| (y - y_mean) * (y - y_mean)).sum::<f64>() / n as f64;
        let y_scale = if variance > 0.0 { variance.sqrt() } else { 1.0 };
        let y = DVector::from_iterator(n, ys.iter().map(|v| (v - y_mean) / y_scale));
        let diagonal = noise * noise + JITTER;
        let mut best: Option<(f64, GaussianProcess)> = None;
        for length_scale in LENGTH_SCALES {
            let k = DMatrix::from_fn(n, n, |i, j| {
                kernel(&xs[i], &xs[j], length_scale) + if i == j { diagonal } else { 0.0 }
            });
            let Some(factor) = Cholesky::new(k) else { continue };
            let weights = factor.solve(&y);
            // log p(y) = -y'K^-1y/2 - log|K|/2 - n log(2 pi)/2; the last term is the same for every scale.
            let log_det: f64 = factor.l_dirty().diagonal().iter().map(|d| d.ln()).sum::<f64>() * 2.0;
            let likelihood = -0.5 * y.dot(&weights) - 0.5 * log_det;
            if !likelihood.is_finite() || best.as_ref().is_some_and(|(b, _)| *b >= likelihood) {
                continue;
            }
            let model = GaussianProcess { xs: xs.to_vec(), length_scale, factor, weights, y_mean, y_scale };
            best = Some((likelihood, model));
        }
        best.map(|(_, model)| model)
    }

    /// The predicted score at `x` and its standard deviation (in the scores' units).
    pub fn predict(&self, x: &[f64]) -> (f64, f64) {
        let k = DVector::from_iterator(self.xs.len(), self.xs.iter().map(|xi| kernel(xi, x, self.length_scale)));
        let mean = k.dot(&self.weights);
        let v = self.factor.l_dirty().solve_lower_triangular(&k).unwrap_or_else(|| DVector::zeros(k.len()));
        let variance = (1.0 - v.dot(&v)).max(0.0);
        (self.y_mean + mean * self.y_scale, variance.sqrt() * self.y_scale)
    }

    pub fn length_scale(&self) -> f64 {
        self.length_scale
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interpolates_noise_free_samples_and_is_unsure_far_from_them() {
        let xs: Vec<Vec<f64>> = (0..6).map(|i| vec![i as f64 / 5.0]).collect();
        let ys: Vec<f64> = xs.iter().map(|x| (3.0 * x[0]).sin() * 100.0 + 1000.0).collect();
        let gp = GaussianProcess::fit(&xs, &ys, 0.0).unwrap();
        for (x, y) in xs.iter().zip(&ys) {
            let (mean, std) = gp.predict(x);
            assert!((mean - y).abs() < 1e-3, "at {x:?}: {mean} vs {y}");
            assert!(std < 1e-2, "at a sample the model is sure: {std}");
        }
        let (mean, _) = gp.predict(&[0.5]);
        assert!((mean - ((1.5f64).sin() * 100.0 + 1000.0)).abs() < 3.0, "between samples: {mean}");
        let few = GaussianProcess::fit(&[vec![0.0]], &[5.0], 0.0).unwrap();
        let (near, far) = (few.predict(&[0.0]).1, few.predict(&[1.0]).1);
        assert!(far > near, "{far} > {near}");
    }

    #[test]
    fn noise_smooths_instead_of_interpolating() {
        let xs: Vec<Vec<f64>> = vec![vec![0.5], vec![0.5], vec![0.5], vec![0.5]];
        let ys = [1.0, 3.0, 1.0, 3.0];
        let gp = GaussianProcess::fit(&xs, &ys, 0.8).unwrap();
        let (mean, _) = gp.predict(&[0.5]);
        assert!((mean - 2.0).abs() < 1e-9, "repeated noisy samples average: {mean}");
    }

    #[test]
    fn nothing_to_fit_is_refused() {
        assert!(GaussianProcess::fit(&[], &[], 0.5).is_none());
        assert!(GaussianProcess::fit(&[vec![0.1]], &[f64::NAN], 0.5).is_none());
        assert!(GaussianProcess::fit(&[vec![0.1]], &[1.0, 2.0], 0.5).is_none());
    }
}
