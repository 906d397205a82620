"""What the tests share: rank launching (mp), model builders and configs, the equivalence matrix's runs and checks,
and the oracles. No test lives here; test modules import from here, never from each other."""
